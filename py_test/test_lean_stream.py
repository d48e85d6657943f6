"""LeanStream's rules without vLLM: driven through the request state's
`make_request_output` and `queue.put`, exactly as vLLM's OutputProcessor calls them."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from vllm_router.engine.vllm.lean import LeanStream
from vllm_router.engine.vllm.params import finish_of


class Detokenizer:
    """Text of each token id, handed out once (vLLM's delta rule)."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.sent = 0

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        text = "".join(f"<{i}>" for i in self.ids[self.sent :])
        self.sent = len(self.ids)
        return text


def state(interval: int = 1, detokenizer: Any = None) -> SimpleNamespace:
    return SimpleNamespace(
        stream_interval=interval, detokenizer=detokenizer, num_cached_tokens=3, queue=None
    )


def output(s: SimpleNamespace, ids: list[int], finish: str | None = None, stop: Any = None) -> None:
    if s.detokenizer is not None:
        s.detokenizer.ids += ids
    assert s.make_request_output(ids, None, finish, stop, None, None) is None  # nothing to queue


async def due(stream: LeanStream) -> bool:
    task = asyncio.ensure_future(stream.next_step())
    await asyncio.sleep(0)
    if task.done():
        return True
    task.cancel()
    return False


async def test_first_tokens_at_once_then_every_interval_and_the_finish_at_once() -> None:
    s = state(interval=4)
    stream = LeanStream("r", s, detokenize=False, prompt_tokens=5)
    output(s, [1])
    first = await stream.next_step()
    assert (first.token_ids, first.finish_reason, first.cached_tokens) == ([1], None, 3)
    output(s, [2])
    output(s, [3])
    output(s, [4])
    assert not await due(stream)  # 3 of 4
    output(s, [5])
    assert (await stream.next_step()).token_ids == [2, 3, 4, 5]
    output(s, [6], finish="length")
    last = await stream.next_step()
    assert (last.token_ids, last.finish_reason) == ([6], "length")
    assert stream.finished


async def test_a_consumer_that_lags_gets_one_merged_batch_with_text() -> None:
    s = state(detokenizer=Detokenizer())
    stream = LeanStream("r", s, detokenize=True, prompt_tokens=5)
    output(s, [7])
    output(s, [8])
    output(s, [9], finish="stop", stop="<9>")
    batch = await stream.next_step()
    assert batch.token_ids == [7, 8, 9]
    assert batch.text == "<7><8><9>"
    assert (batch.finish_reason, batch.stop_reason) == ("stop", "<9>")


async def test_a_waiting_consumer_is_woken_by_the_output() -> None:
    s = state()
    stream = LeanStream("r", s, detokenize=False, prompt_tokens=5)
    waiting = asyncio.ensure_future(stream.next_step())
    await asyncio.sleep(0)
    assert not waiting.done()
    output(s, [4, 5])
    assert (await asyncio.wait_for(waiting, 1)).token_ids == [4, 5]


async def test_an_abort_ends_the_stream_and_an_engine_error_reaches_the_consumer() -> None:
    s = state()
    stream = LeanStream("r", s, detokenize=False, prompt_tokens=5)
    # vLLM's abort_requests calls make_request_output with keywords.
    s.make_request_output(
        new_token_ids=[],
        pooling_output=None,
        finish_reason="abort",
        stop_reason=None,
        kv_transfer_params=None,
        ec_transfer_params=None,
    )
    assert (await stream.next_step()).finish_reason == "abort"

    s = state()
    stream = LeanStream("r", s, detokenize=False, prompt_tokens=5)
    waiting = asyncio.ensure_future(stream.next_step())
    await asyncio.sleep(0)
    s.queue.put(RuntimeError("engine core died"))  # OutputProcessor.propagate_error
    with pytest.raises(RuntimeError, match="engine core died"):
        await asyncio.wait_for(waiting, 1)


async def test_an_output_queued_before_the_takeover_is_not_lost() -> None:
    early = SimpleNamespace(
        outputs=[
            SimpleNamespace(token_ids=[1, 2], text="ab", finish_reason="length", stop_reason=None)
        ],
        kv_transfer_params={"handle": 1},
    )
    # vLLM already dropped the finished request
    stream = LeanStream("r", None, detokenize=True, prompt_tokens=5)
    stream.absorb(early)
    batch = await stream.next_step()
    assert (batch.token_ids, batch.text, batch.finish_reason) == ([1, 2], "ab", "length")
    assert batch.kv_transfer_params == {"handle": 1}


class Broken:
    """A detokenizer that fails on the second step (a bug of ours or a changed vLLM)."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.calls = 0

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        self.calls += 1
        if self.calls == 2:
            raise KeyError("boom")
        return "x"


async def test_a_failing_handler_fails_its_request_and_never_raises_into_vllm() -> None:
    s = state(detokenizer=Broken())
    stream = LeanStream("r", s, detokenize=True, prompt_tokens=5)
    output(s, [1])
    assert (await stream.next_step()).token_ids == [1]
    output(s, [2])  # raises inside: vLLM's output handler must not see it (asserts None)
    output(s, [3], finish="length")  # ignored once failed
    with pytest.raises(RuntimeError, match=r"output handler failed.*KeyError"):
        await stream.next_step()
    assert not stream.finished  # so the consumer's exit aborts the request in the engine


@pytest.mark.parametrize(
    ("vllm_reason", "stop", "expected"),
    [
        ("stop", None, ("stop", 9, None)),  # EOS: the last token is the match
        ("stop", "END", ("stop", "END", None)),
        ("length", None, ("length", None, None)),
        ("abort", None, ("abort", None, None)),
        ("repetition", "repetition_detected", ("repetition", None, None)),
        ("error", None, ("error", None, "vLLM gave no detail")),
        (
            "weird",
            None,
            ("error", None, "vLLM finished the request with an unknown reason 'weird'"),
        ),
        (None, None, (None, None, None)),
    ],
)
def test_every_vllm_finish_reason_maps_honestly(vllm_reason: Any, stop: Any, expected: Any) -> None:
    assert finish_of(vllm_reason, stop, 9) == expected


def test_an_error_finish_carries_the_engines_message() -> None:
    detail = SimpleNamespace(message="KV transfer failed")
    assert finish_of("error", None, 9, detail) == ("error", None, "KV transfer failed")
