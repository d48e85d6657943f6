"""What the mutation pass over the direct path (`make mutate`, benchmarks/results/mutation.md)
found no test asserting: a step's usage and finish as LeanStream tells them, the matched stop
of an EOS finish, the text held back for a stop string, the rule's "never the first step, never
past buffered tokens" inside LeanStream, when a stream counts as stalled, a drain abort told as
UNAVAILABLE, and the per-request metrics a flight keeps. Without vLLM or gRPC: the fakes of
test_lean_stream.py and test_direct_steps.py, and the mock engine in-process."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

import pytest
from test_direct_steps import Receiver, engine_steps, render, step
from test_lean_stream import output, state

from vllm_router.core.batching import Lane, Outbox
from vllm_router.core.flight import SHUT_DOWN, Flight
from vllm_router.core.health import ServingState
from vllm_router.core.metrics import ServicerMetrics
from vllm_router.core.requests import RequestTable
from vllm_router.engine import EngineStep, GenerationRequest, SamplingOptions, SpecDecodeCounts
from vllm_router.engine.vllm.lean import LeanStream
from vllm_router.errors import EngineUnavailable
from vllm_router.testing.mock_engine import MockAsyncEngine, MockConfig

# -- LeanStream: what each step tells ----------------------------------------------------------


async def test_each_step_tells_the_requests_usage_and_only_the_last_is_finished() -> None:
    s = state()  # 3 cached prompt tokens
    stream = LeanStream("r", s, detokenize=False, prompt_tokens=5)
    output(s, [1])
    first = await stream.next_step()
    assert (first.finished, first.finish_reason, first.text, first.error) == (False, None, "", None)
    assert (first.prompt_tokens, first.completion_tokens, first.cached_tokens) == (5, 1, 3)
    assert first.kv_transfer_params is None
    # The finish, as vLLM's OutputProcessor hands it: with the KV connector's parameters
    # (prefill/decode disaggregation: what the decode worker needs from this one).
    s.make_request_output([2, 3], None, "length", None, {"remote_block_ids": [4]}, None)
    last = await stream.next_step()
    assert (last.token_ids, last.finished, last.finish_reason, last.text) == (
        [2, 3],
        True,
        "length",
        "",
    )
    assert (last.prompt_tokens, last.completion_tokens, last.cached_tokens) == (5, 3, 3)
    assert last.kv_transfer_params == {"remote_block_ids": [4]}


async def test_an_error_finish_tells_the_engines_message() -> None:
    s = state()
    stream = LeanStream("r", s, detokenize=False, prompt_tokens=5)
    detail = SimpleNamespace(message="KV transfer failed")
    s.make_request_output([], None, "error", None, None, None, detail)
    last = await stream.next_step()
    assert (last.finished, last.finish_reason, last.error) == (True, "error", "KV transfer failed")


async def test_an_eos_finish_reports_the_eos_token_as_its_matched_stop() -> None:
    """vLLM gives no stop reason for EOS: the last token the request produced is the match
    (the EOS id a router reports as matched_stop)."""
    s = state()
    stream = LeanStream("r", s, detokenize=False, prompt_tokens=5)
    output(s, [1])
    await stream.next_step()
    output(s, [2, 99], finish="stop")
    last = await stream.next_step()
    assert (last.finish_reason, last.stop_reason) == ("stop", 99)


async def test_an_output_queued_before_the_takeover_keeps_its_matched_stop() -> None:
    early = SimpleNamespace(
        outputs=[
            SimpleNamespace(token_ids=[1, 2], text="", finish_reason="stop", stop_reason="END")
        ],
        kv_transfer_params=None,
    )
    stream = LeanStream("r", None, detokenize=False, prompt_tokens=5)  # vLLM dropped it
    stream.absorb(early)
    last = await stream.next_step()
    assert (last.finish_reason, last.stop_reason, last.finished) == ("stop", "END", True)
    assert (last.completion_tokens, last.cached_tokens) == (2, 0)


class StopBuffer:
    """vLLM's incremental detokenizer's text rule (BaseIncrementalDetokenizer): while a
    request has stop strings, the last `held` characters are held back (they may start a
    stop string) until it finishes; `delta` hands out only the text not handed out before."""

    def __init__(self, held: int) -> None:
        self.ids: list[int] = []  # what test_lean_stream.output appends to
        self.held = held
        self.offset = 0

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        text = "".join(f"<{i}>" for i in self.ids)
        held = 0 if finished else self.held
        if not delta:
            return text[: len(text) - held]
        end = len(text) - held
        if self.offset < end:
            start, self.offset = self.offset, end
            return text[start:end]
        return ""


async def test_text_held_back_for_a_stop_string_comes_whole_at_the_finish() -> None:
    s = state(detokenizer=StopBuffer(held=2))
    stream = LeanStream("r", s, detokenize=True, prompt_tokens=5)
    texts = []
    output(s, [1])
    texts.append((await stream.next_step()).text)
    output(s, [2])
    texts.append((await stream.next_step()).text)
    output(s, [3], finish="length")
    texts.append((await stream.next_step()).text)
    assert texts == ["<", "1><", "2><3>"]  # each character once, none lost
    assert "".join(texts) == "<1><2><3>"


async def test_only_the_last_step_tells_the_requests_speculative_decoding_counts() -> None:
    """vLLM's per-request counts (--per-request-spec-decode-metrics, RequestSpecDecodeMetrics
    on the request state): the drafts proposed and, from the histogram of drafts accepted
    per verify step, the accepted ones; a request without them tells none."""
    s = state()
    s.spec_decode_metrics = SimpleNamespace(num_draft_tokens=6, histogram=[1, 0, 2])
    stream = LeanStream("r", s, detokenize=False, prompt_tokens=5)
    output(s, [1])
    assert (await stream.next_step()).spec_decode is None
    output(s, [2, 3], finish="length")
    last = await stream.next_step()
    assert last.spec_decode == SpecDecodeCounts(draft_tokens=6, accepted_tokens=4)

    plain = state()  # speculative decoding off: vLLM's state has no counts
    stream = LeanStream("r", plain, detokenize=False, prompt_tokens=5)
    output(plain, [1], finish="length")
    assert (await stream.next_step()).spec_decode is None


# -- LeanStream under the rule of engine/direct.py ---------------------------------------------


async def test_the_first_step_is_never_given_direct_even_to_a_waiting_consumer() -> None:
    """The consumer renders the first step itself (a flight's direct send renders every later
    step from it; a lane's counts come from it)."""
    s, receiver = state(), Receiver()
    stream = LeanStream("r", s, detokenize=False, prompt_tokens=5, receiver=receiver)
    waiting = asyncio.ensure_future(stream.next_step())
    await asyncio.sleep(0)  # the consumer waits for the first step, nothing buffered
    stream.plain_step([1])
    assert receiver.given == 0
    assert (await asyncio.wait_for(waiting, 1)).token_ids == [1]


async def test_a_plain_step_never_overtakes_tokens_buffered_for_the_consumer() -> None:
    """Tokens buffered but not yet due (a stream interval of 2) stay ahead of a later plain
    step: it is buffered behind them, not given direct past them."""
    s, receiver = state(interval=2), Receiver()
    stream = LeanStream("r", s, detokenize=False, prompt_tokens=5, receiver=receiver)
    output(s, [1])
    assert (await stream.next_step()).token_ids == [1]
    waiting = asyncio.ensure_future(stream.next_step())
    await asyncio.sleep(0)
    output(s, [2])  # 1 of 2: buffered, the consumer still waits
    stream.plain_step([3])
    assert receiver.given == 0
    assert (await asyncio.wait_for(waiting, 1)).token_ids == [2, 3]


# -- Flight: stalls, a drain abort, metrics ----------------------------------------------------


async def test_a_stream_counts_as_stalled_only_while_a_message_waits_for_its_client() -> None:
    """What the stall watchdog reads (RequestTable.watch_stalled_streams)."""
    flight = Flight("r", None)
    assert flight.stalled_since() is None  # nothing sent yet
    flight.begin(engine_steps(step([1], 1), step([2], 2, finished=True)))
    messages = flight.messages(render)
    before = time.monotonic()
    await messages.__anext__()  # handed to gRPC, not yet taken by the client
    since = flight.stalled_since()
    assert since is not None and before <= since <= time.monotonic()
    assert [m async for m in messages] == [([2], 5, 2, 2)]  # every message taken
    assert flight.stalled_since() is None


async def test_a_stream_waiting_for_its_first_step_is_not_stalled() -> None:
    """A stream whose engine has not made its first step yet (a long prompt's prefill) has
    said nothing and waits for the engine, which is no stall; its first message, once handed
    to gRPC, counts as stalled until the client takes it."""
    prefilled = asyncio.Event()

    async def prefilling() -> Any:
        await prefilled.wait()
        yield step([1], 1, finished=True)

    flight = Flight("r", None)
    flight.begin(prefilling())
    messages = flight.messages(render)
    first = asyncio.ensure_future(messages.__anext__())
    await asyncio.sleep(0)
    assert not first.done() and flight.stalled_since() is None
    prefilled.set()
    before = time.monotonic()
    assert await asyncio.wait_for(first, 1) == ([1], 5, 1, 2)
    since = flight.stalled_since()
    assert since is not None and before <= since <= time.monotonic()
    assert [m async for m in messages] == []
    assert flight.stalled_since() is None


async def test_a_batched_request_is_stalled_when_its_sessions_sender_is() -> None:
    outbox: Outbox[Any, Any] = Outbox()
    flight = Flight("r", None)
    flight.send_clock = outbox
    assert flight.stalled_since() is None  # the session has sent nothing yet
    flight.answering()  # the request's update goes into the session's next message
    assert flight.stalled_since() is None  # the session's sender sends it, not this flight
    outbox.sending_since = 12.5
    assert flight.stalled_since() == 12.5


async def test_a_drain_abort_ends_the_request_unavailable_and_aborts_it_in_the_engine() -> None:
    engine = MockAsyncEngine(MockConfig(step_delay=0.01))
    table = RequestTable(engine, ServingState(engine))
    request = GenerationRequest(
        "drained",
        [1, 2, 3],
        None,
        SamplingOptions(max_tokens=300, ignore_eos=True),
        detokenize=False,
    )
    started = asyncio.Event()
    steps: list[EngineStep] = []

    async def consume() -> None:
        async with table.run(request) as flight:
            async for one in flight.steps():
                steps.append(one)
                started.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(started.wait(), 5)
    await table.abort_all()  # the drain's grace period is over
    with pytest.raises(EngineUnavailable) as failure:
        await asyncio.wait_for(task, 5)
    assert str(failure.value) == SHUT_DOWN
    assert "drained" in engine.aborted_ids
    assert not steps[-1].finished  # the abort was never handed out as the answer's end


async def test_a_finish_while_shutting_down_that_is_no_abort_is_an_answer() -> None:
    flight = Flight("r", None)
    flight.shut_down = True
    flight.begin(engine_steps(step([1], 1), step([2], 2, finished=True)))
    assert [one.finish_reason async for one in flight.steps()] == [None, "length"]


async def test_a_flights_metrics_time_the_request_and_name_every_finish() -> None:
    metrics = ServicerMetrics()
    started = time.monotonic()
    flight = Flight("r", metrics)
    no_reason = EngineStep(
        token_ids=[2],
        text="",
        finished=True,
        prompt_tokens=5,
        completion_tokens=2,
        cached_tokens=2,
    )
    flight.begin(engine_steps(step([1], 1), no_reason))
    assert [m async for m in flight.messages(render)] == [([1], 5, 1, 2), ([2], 5, 2, 2)]
    flight.finished()
    elapsed = time.monotonic() - started

    def value(name: str, labels: dict[str, str] | None = None) -> float:
        found = metrics.registry.get_sample_value(f"vllm_servicer:{name}", labels or {})
        assert found is not None, name
        return found

    assert value("finish_reason_total", {"reason": "unknown"}) == 1
    assert value("generated_tokens_total") == 2
    for histogram in ("time_to_first_message_seconds", "request_duration_seconds"):
        assert value(f"{histogram}_count") == 1
        assert 0 <= value(f"{histogram}_sum") <= elapsed, histogram
    assert value("time_between_messages_seconds_count") == 1
    assert 0 <= value("time_between_messages_seconds_sum") <= elapsed


# -- A batched stream's lane -------------------------------------------------------------------


async def test_tokens_a_request_claims_from_its_lane_are_counted_once_and_leave_with_it() -> None:
    counted: list[int] = []
    outbox: Outbox[Any, Any] = Outbox(counted.append)
    lane = Lane("r", outbox, compact=False)
    lane.claim(step([1], 1))  # the request's first step, from its task
    assert lane([5, 6], 3)  # plain steps, given direct
    claimed = lane.claim(step([7], 4, finished=True))  # the task's next step comes after them
    assert claimed.token_ids == [5, 6, 7]
    assert counted == [2]  # the lane's tokens, counted as they leave (the step's are the flight's)
    assert outbox.take() is None  # nothing left behind for the session's next message
