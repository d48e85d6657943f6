"""Direct steps (engine/direct.py) and a stream's direct sends (core/flight.py), without vLLM
or gRPC: when a plain step goes direct to the receiver, when it is buffered, how it is
counted, and what a refused step becomes (merged into the next step the consumer takes, in
order)."""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import replace
from typing import Any

import pytest
from test_lean_stream import output, state

from vllm_router.core.flight import DirectSend, Flight
from vllm_router.engine import DirectSteps, EngineStep, SamplingOptions, takes_direct_steps
from vllm_router.engine.vllm.lean import LeanStream


class Receiver:
    """A receiver that takes what it is given, or refuses while `refusing`."""

    def __init__(self) -> None:
        self.taken: list[list[int]] = []
        self.told: list[int] = []  # the completion tokens told with each taken step
        self.given = 0
        self.refusing = False

    def __call__(self, token_ids: list[int], completion_tokens: int) -> bool:
        self.given += 1
        if self.refusing:
            return False
        self.taken.append(token_ids)
        self.told.append(completion_tokens)
        return True


@pytest.mark.parametrize(
    ("first", "waiting", "buffered"), list(itertools.product((True, False), repeat=3))
)
def test_a_plain_step_goes_direct_never_first_only_while_the_consumer_waits_idle(
    first: bool, waiting: bool, buffered: bool
) -> None:
    receiver = Receiver()
    direct = DirectSteps(receiver)
    taken = direct.give([5, 6], first=first, waiting=waiting, buffered=buffered)
    allowed = not first and waiting and not buffered
    assert taken is allowed and receiver.given == int(allowed)
    assert (direct.produced, direct.last_token) == ((2, 6) if allowed else (0, None))


def test_an_empty_step_or_no_receiver_is_never_given() -> None:
    receiver = Receiver()
    idle = {"first": False, "waiting": True, "buffered": False}
    assert not DirectSteps(receiver).give([], **idle)
    assert not DirectSteps(None).give([1], **idle)
    assert receiver.given == 0


def test_the_request_is_counted_once_the_receiver_is_told_the_count_a_refusal_is_not_counted() -> (
    None
):
    receiver = Receiver()
    direct = DirectSteps(receiver)
    idle = {"first": False, "waiting": True, "buffered": False}
    direct.count([1])  # the first step, yielded
    receiver.refusing = True
    assert not direct.give([2], **idle)
    assert direct.produced == 1  # the engine buffers it: counted when yielded
    direct.count([2])
    receiver.refusing = False
    assert direct.give([3, 4], **idle)
    assert (direct.produced, direct.last_token, receiver.taken) == (4, 4, [[3, 4]])
    assert receiver.told == [4]  # the request's completion tokens with the step's


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
def test_only_plain_token_only_requests_streamed_at_every_step_take_direct_steps(
    options: SamplingOptions, samples: int, detokenize: bool, expected: bool
) -> None:
    takes = takes_direct_steps(options, samples, detokenize=detokenize, engine_interval=1)
    assert takes is expected
    # An engine that streams every request at a longer interval of its own gives none.
    assert not takes_direct_steps(options, samples, detokenize=detokenize, engine_interval=2)


# -- LeanStream (the vLLM adapter) under the rule ----------------------------------------------


async def test_lean_stream_gives_direct_only_while_its_consumer_waits_and_merges_refusals() -> None:
    s, receiver = state(), Receiver()
    stream = LeanStream("r", s, detokenize=False, prompt_tokens=5, receiver=receiver)
    stream.plain_step([1])  # before the consumer took its first step: buffered
    first = await stream.next_step()
    assert (first.token_ids, first.completion_tokens, receiver.given) == ([1], 1, 0)

    stream.plain_step([2])  # nobody waits: buffered, never given
    waiting = asyncio.ensure_future(stream.next_step())
    assert (await asyncio.wait_for(waiting, 1)).token_ids == [2] and receiver.given == 0

    waiting = asyncio.ensure_future(stream.next_step())
    await asyncio.sleep(0)
    stream.plain_step([3])  # the consumer waits with nothing buffered: taken
    stream.plain_step([4])
    assert receiver.taken == [[3], [4]] and receiver.told == [3, 4] and not waiting.done()

    receiver.refusing = True
    stream.plain_step([5])  # refused: buffered, and the consumer woken for it
    stream.plain_step([6])  # arrives before the consumer ran: merged, not given
    assert receiver.given == 3
    merged = await asyncio.wait_for(waiting, 1)
    assert (merged.token_ids, merged.completion_tokens) == ([5, 6], 6)

    receiver.refusing = False
    waiting = asyncio.ensure_future(stream.next_step())
    await asyncio.sleep(0)
    stream.plain_step([7])
    output(s, [8], finish="length")  # the last step is never given
    last = await asyncio.wait_for(waiting, 1)
    assert (last.token_ids, last.finish_reason, last.completion_tokens) == ([8], "length", 8)
    assert receiver.taken == [[3], [4], [7]]


async def test_a_woken_consumer_waits_no_more_so_nothing_goes_direct_while_it_is_busy() -> None:
    """Once a step wakes the consumer (`LeanStream._wake`), it no longer waits: a plain step
    that arrives while it is busy with that step is buffered for it, never given direct (the
    receiver's tokens would overtake the step it is still sending)."""
    s, receiver = state(), Receiver()
    stream = LeanStream("r", s, detokenize=False, prompt_tokens=5, receiver=receiver)
    output(s, [1])
    assert (await stream.next_step()).token_ids == [1]  # the first step
    waiting = asyncio.ensure_future(stream.next_step())
    await asyncio.sleep(0)  # the consumer waits
    output(s, [2])  # a step vLLM's own path makes: it wakes the consumer
    assert (await asyncio.wait_for(waiting, 1)).token_ids == [2]
    stream.plain_step([3])  # the consumer is busy with [2]: not waiting
    assert receiver.given == 0
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
    """`render`'s message for a plain step, as a contract's direct-step renderer makes it."""
    return (token_ids, last.prompt_tokens, completion, last.cached_tokens)


async def test_a_flight_sends_plain_steps_itself_with_their_usage_after_its_first_message() -> None:
    transport = Transport()
    flight = Flight("r", None, DirectSend(transport, decode))
    receiver = flight.receiver
    assert receiver is not None
    assert not receiver([1], 1)  # no message sent yet (the rule never gives the first step)
    flight.begin(engine_steps(step([1], 1), step([4], 4, finished=True)))
    messages = flight.messages(render)
    assert await messages.__anext__() == ([1], 5, 1, 2)  # the first step, from the task
    assert receiver([2], 2) and receiver(
        [3], 3
    )  # plain steps: rendered, sent from the engine's loop
    assert transport.sent == [([2], 5, 2, 2), ([3], 5, 3, 2)]
    transport.full = True
    assert not receiver([4], 4)  # refused: the engine buffers it, the task sends it
    assert transport.sent == [([2], 5, 2, 2), ([3], 5, 3, 2)]
    assert [m async for m in messages] == [([4], 5, 4, 2)]


async def test_a_flight_without_a_direct_send_has_no_receiver() -> None:
    """Every step is then the task's to send: the engine is given no receiver."""
    assert Flight("r", None).receiver is None
    assert Flight("r", None, DirectSend(Transport(), decode)).receiver is not None


async def test_a_direct_send_that_fails_never_raises_into_the_engine() -> None:
    """It runs inside the engine's output loop: a renderer that raises (a bug) is refused, so
    the step is left to the task, whose step renderer sends it; nothing raises into the
    engine."""
    transport = Transport()

    def failing_decode(token_ids: list[int], last: EngineStep, completion: int) -> Any:
        raise KeyError("a bug")

    flight = Flight("r", None, DirectSend(transport, failing_decode))
    receiver = flight.receiver
    assert receiver is not None
    flight.begin(engine_steps(step([1], 1)))
    messages = flight.messages(render)
    await messages.__anext__()
    assert not receiver([2], 2) and transport.sent == []
