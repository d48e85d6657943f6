"""The hand-off (engine/handoff.py) and a stream's direct sends (core/flight.py), without vLLM
or gRPC: when a step is handed off to the sink, when it is buffered, how it is counted, and
what a refused step becomes (merged into the next step the consumer takes, in order)."""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import replace
from typing import Any

import pytest
from test_lean_stream import output, state

from vllm_router.core.flight import DirectSend, Flight
from vllm_router.engine import EngineStep, Handoff, SamplingOptions, may_hand_off
from vllm_router.engine.vllm.lean import LeanStream


class Sink:
    """A sink that takes what it is offered, or refuses while `refusing`."""

    def __init__(self) -> None:
        self.taken: list[list[int]] = []
        self.told: list[int] = []  # the completion tokens told with each taken step
        self.offers = 0
        self.refusing = False

    def __call__(self, token_ids: list[int], completion_tokens: int) -> bool:
        self.offers += 1
        if self.refusing:
            return False
        self.taken.append(token_ids)
        self.told.append(completion_tokens)
        return True


@pytest.mark.parametrize(
    ("first", "last", "waiting", "buffered"), list(itertools.product((True, False), repeat=4))
)
def test_a_step_is_handed_off_never_first_or_last_only_while_the_consumer_waits_idle(
    first: bool, last: bool, waiting: bool, buffered: bool
) -> None:
    sink = Sink()
    handoff = Handoff(sink)
    taken = handoff.offer([5, 6], first=first, last=last, waiting=waiting, buffered=buffered)
    allowed = not first and not last and waiting and not buffered
    assert taken is allowed and sink.offers == int(allowed)
    assert (handoff.produced, handoff.last_token) == ((2, 6) if allowed else (0, None))


def test_an_empty_step_or_no_sink_is_never_offered() -> None:
    sink = Sink()
    idle = {"first": False, "last": False, "waiting": True, "buffered": False}
    assert not Handoff(sink).offer([], **idle)
    assert not Handoff(None).offer([1], **idle)
    assert sink.offers == 0


def test_the_request_is_counted_once_the_sink_is_told_the_count_a_refusal_is_not_counted() -> None:
    sink = Sink()
    handoff = Handoff(sink)
    idle = {"first": False, "last": False, "waiting": True, "buffered": False}
    handoff.count([1])  # the first step, yielded
    sink.refusing = True
    assert not handoff.offer([2], **idle)
    assert handoff.produced == 1  # the engine buffers it: counted when yielded
    handoff.count([2])
    sink.refusing = False
    assert handoff.offer([3, 4], **idle)
    assert (handoff.produced, handoff.last_token, sink.taken) == (4, 4, [[3, 4]])
    assert sink.told == [4]  # the request's completion tokens with the step's


PLAIN = SamplingOptions(max_tokens=8)


@pytest.mark.parametrize(
    ("options", "samples", "detokenize", "expected"),
    [
        (PLAIN, 1, False, True),
        (PLAIN, 1, True, False),  # text: each step carries a text delta
        (PLAIN, 2, False, False),  # several samples
        (replace(PLAIN, logprobs=0), 1, False, False),
        (replace(PLAIN, logprob_token_ids=(3,)), 1, False, False),
        (replace(PLAIN, prompt_logprobs=1), 1, False, False),
        (replace(PLAIN, stream_interval=4), 1, False, False),
        (replace(PLAIN, stream_interval=1), 1, False, True),
    ],
    ids=[
        "plain",
        "text",
        "n=2",
        "logprobs",
        "token logprobs",
        "prompt logprobs",
        "interval 4",
        "interval 1",
    ],
)
def test_only_plain_token_only_requests_streamed_at_every_step_may_hand_off(
    options: SamplingOptions, samples: int, detokenize: bool, expected: bool
) -> None:
    assert may_hand_off(options, samples, detokenize=detokenize) is expected
    # An engine that streams every request at a longer interval of its own hands none off.
    assert not may_hand_off(options, samples, detokenize=detokenize, engine_interval=2)


# -- LeanStream (the vLLM adapter) under the rule ----------------------------------------------


async def test_lean_stream_hands_off_only_while_its_consumer_waits_and_merges_refusals() -> None:
    s, sink = state(), Sink()
    stream = LeanStream("r", s, detokenize=False, prompt_tokens=5, sink=sink)
    stream.decode_step([1])  # before the consumer took its first step: buffered
    first = await stream.next_step()
    assert (first.token_ids, first.completion_tokens, sink.offers) == ([1], 1, 0)

    stream.decode_step([2])  # nobody waits: buffered, never offered
    waiting = asyncio.ensure_future(stream.next_step())
    assert (await asyncio.wait_for(waiting, 1)).token_ids == [2] and sink.offers == 0

    waiting = asyncio.ensure_future(stream.next_step())
    await asyncio.sleep(0)
    stream.decode_step([3])  # the consumer waits with nothing buffered: taken
    stream.decode_step([4])
    assert sink.taken == [[3], [4]] and sink.told == [3, 4] and not waiting.done()

    sink.refusing = True
    stream.decode_step([5])  # refused: buffered, and the consumer woken for it
    stream.decode_step([6])  # arrives before the consumer ran: merged, not offered
    assert sink.offers == 3
    merged = await asyncio.wait_for(waiting, 1)
    assert (merged.token_ids, merged.completion_tokens) == ([5, 6], 6)

    sink.refusing = False
    waiting = asyncio.ensure_future(stream.next_step())
    await asyncio.sleep(0)
    stream.decode_step([7])
    output(s, [8], finish="length")  # the last step is never offered
    last = await asyncio.wait_for(waiting, 1)
    assert (last.token_ids, last.finish_reason, last.completion_tokens) == ([8], "length", 8)
    assert sink.taken == [[3], [4], [7]]


async def test_a_woken_consumer_waits_no_more_so_nothing_is_handed_off_while_it_is_busy() -> None:
    """Once a step wakes the consumer (`LeanStream._wake`), it no longer waits: a decode step
    that arrives while it is busy with that step is buffered for it, never handed off (the
    sink's tokens would overtake the step it is still sending)."""
    s, sink = state(), Sink()
    stream = LeanStream("r", s, detokenize=False, prompt_tokens=5, sink=sink)
    output(s, [1])
    assert (await stream.next_step()).token_ids == [1]  # the first step
    waiting = asyncio.ensure_future(stream.next_step())
    await asyncio.sleep(0)  # the consumer waits
    output(s, [2])  # a step vLLM's own path makes: it wakes the consumer
    assert (await asyncio.wait_for(waiting, 1)).token_ids == [2]
    stream.decode_step([3])  # the consumer is busy with [2]: not waiting
    assert sink.offers == 0
    later = await asyncio.wait_for(stream.next_step(), 1)
    assert (later.token_ids, later.completion_tokens) == ([3], 3)


# -- Flight: a stream's direct sends ---------------------------------------------------------


class Transport:
    """A direct send: records what it took, or refuses (the client's window is full)."""

    def __init__(self) -> None:
        self.sent: list[Any] = []
        self.full = False

    def __call__(self, message: Any) -> bool:
        if self.full:
            return False
        self.sent.append(message)
        return True


def step(token_ids: list[int], completion: int, finished: bool = False) -> EngineStep:
    return EngineStep(
        token_ids=token_ids,
        text="",
        finished=finished,
        finish_reason="length" if finished else None,
        prompt_tokens=5,
        completion_tokens=completion,
        cached_tokens=2,
    )


async def engine_steps(*steps: EngineStep) -> Any:
    for one in steps:
        yield one


def render(one: EngineStep) -> tuple[tuple[list[int], int, int, int]]:
    return ((one.token_ids, one.prompt_tokens, one.completion_tokens, one.cached_tokens),)


def decode(
    token_ids: list[int], last: EngineStep, completion: int
) -> tuple[list[int], int, int, int]:
    """`render`'s message for a plain decode step, as a contract's decode renderer makes it."""
    return (token_ids, last.prompt_tokens, completion, last.cached_tokens)


async def test_a_flight_sends_decode_steps_itself_with_their_usage_after_its_first_message() -> (
    None
):
    flight, transport = Flight("r", None), Transport()
    sink = flight.sink(DirectSend(transport))
    assert not sink([1], 1)  # no message sent yet (the hand-off rule never offers it)
    flight.begin(engine_steps(step([1], 1), step([4], 4, finished=True)))
    messages = flight.messages(render, decode)
    assert await messages.__anext__() == ([1], 5, 1, 2)  # the first step, from the task
    assert sink([2], 2) and sink([3], 3)  # decode steps: rendered, sent from the engine's loop
    assert transport.sent == [([2], 5, 2, 2), ([3], 5, 3, 2)]
    transport.full = True
    assert not sink([4], 4)  # refused: the engine buffers it, the task sends it
    assert transport.sent == [([2], 5, 2, 2), ([3], 5, 3, 2)]
    assert [m async for m in messages] == [([4], 5, 4, 2)]


async def test_a_stream_without_a_decode_renderer_leaves_every_step_to_the_task() -> None:
    flight, transport = Flight("r", None), Transport()
    sink = flight.sink(DirectSend(transport))
    flight.begin(engine_steps(step([1], 1), step([2], 2, finished=True)))
    messages = flight.messages(render)
    await messages.__anext__()
    assert not sink([2], 2) and transport.sent == []
    assert [m async for m in messages] == [([2], 5, 2, 2)]


async def test_a_direct_send_that_fails_never_raises_into_the_engine() -> None:
    """It runs inside the engine's output loop: a decode renderer that raises (a bug) is
    refused, so the step is left to the task, whose step renderer sends it; nothing raises
    into the engine."""
    flight, transport = Flight("r", None), Transport()
    sink = flight.sink(DirectSend(transport))
    flight.begin(engine_steps(step([1], 1)))

    def failing_decode(token_ids: list[int], last: EngineStep, completion: int) -> Any:
        raise KeyError("a bug")

    messages = flight.messages(render, failing_decode)
    await messages.__anext__()
    assert not sink([2], 2) and transport.sent == []
