"""A request in flight: its engine steps, counted and checked, and its send accounting.

`Flight` is what `RequestTable.run` yields; handlers read steps from it, never from the
engine, so the bookkeeping every contract needs (token and finish counters, the timing
histograms, what the stall watchdog watches, a drain abort told as UNAVAILABLE) is here once.

A stream on a transport with a direct send (a send that never waits, such as
pygrpc-native's) is fed straight from engine steps: the flight is the receiver the engine
gives the request's plain steps to direct (engine/direct.py, which alone says which steps),
renders each into the stream's next message from the engine's output loop (the contract's
`DirectStepRenderer`, prebuilt for the stream) and passes it to the direct send. No task
wakes, no generator resumes. When the transport cannot take it (the client's window is
full) the step is refused, the engine buffers it and the request's task sends it the
awaited way, merged with the steps that arrive meanwhile: steps coalesce only under
back-pressure, and a token is never held back while the pipe is free.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from ..engine import DirectReceiver, EngineStep
from ..errors import EngineUnavailable
from .metrics import ServicerMetrics

logger = logging.getLogger(__name__)

Message = TypeVar("Message")

SHUT_DOWN = (
    "server shut down before the request finished (aborted after the drain grace period); "
    "retry on another worker"
)


# A stream's send that never waits, as its transport gives it: `send(message)` sends one
# response message; True if the transport took it (it goes out after every message before
# it), False if it cannot now (the client's flow-control window is full, the transport
# still holds the message before it, or the stream has ended). It never blocks or raises.
TransportSend = Callable[[Any], bool]

# A contract's prebuilt rendering of a plain step (new token ids and nothing else) into the
# stream's message: the same message its step renderer makes of that step, built without
# an EngineStep. Called with the new token ids, the step rendered before it (prompt and
# cached token counts, sample index) and the request's completion tokens with them. One per
# stream, and it may return the same message object every call, rendered again (cheaper
# than building one: benchmarks/results/per-message-python.md): whoever calls it encodes
# the message before calling it again, as a direct send does.
DirectStepRenderer = Callable[[list[int], EngineStep, int], Any]


@dataclass(frozen=True, slots=True)
class DirectSend:
    """A stream's direct send: the transport's send and the contract's renderer for it."""

    send: TransportSend
    render: DirectStepRenderer


class SendClock(Protocol):
    """Whatever sends a request's messages, seen by the stall watchdog."""

    sending_since: float | None


class Flight:
    """One admitted request: its engine steps, what the stall watchdog watches, its metrics.

    A handler takes the request's steps from here, already counted and checked
    (`steps`, or `messages` for a stream, which also does the send accounting), so
    no contract can forget that a drain abort is UNAVAILABLE, not an answer.
    """

    __slots__ = ("_direct", "_engine_steps", "_last_sent", "_last_step",
                 "_metrics", "_started", "failure", "request_id", "send_clock", "sending_since",
                 "shut_down", "task")  # fmt: skip

    def __init__(
        self,
        request_id: str,
        metrics: ServicerMetrics | None,
        direct_send: DirectSend | None = None,
    ) -> None:
        """`direct_send`: the stream's, through which the flight sends its plain steps itself
        (`receiver`); None: every step is the task's to send."""
        self.request_id = request_id
        self.task = asyncio.current_task()
        # Monotonic time since which a message has been waiting for the client to take it.
        self.sending_since: float | None = None
        # Set when another object sends this request's messages (a batched stream's
        # sender): the watchdog reads its clock instead.
        self.send_clock: SendClock | None = None
        self.shut_down = False
        # Set with the task's cancellation when the server ends the request for a cause
        # the client must hear (the engine stopped making progress): raised in its place.
        self.failure: Exception | None = None
        self._metrics = metrics
        self._started = time.monotonic()
        self._last_sent: float | None = None
        self._engine_steps: AsyncIterator[EngineStep] | None = None
        # Its direct send, and the last step the task rendered (what a plain step's
        # message takes its prompt and cached token counts from).
        self._direct = direct_send
        self._last_step: EngineStep | None = None

    @property
    def receiver(self) -> DirectReceiver | None:
        """What the engine gives this request's plain steps to direct (None without a
        direct send): each is sent as the stream's next message (see the module docstring)."""
        return self._receive if self._direct is not None else None

    def begin(self, engine_steps: AsyncIterator[EngineStep]) -> None:
        """The request runs in the engine now; these are its steps."""
        self._engine_steps = engine_steps

    async def steps(self) -> AsyncIterator[EngineStep]:
        """The request's engine steps, each one counted (for answers sent at the end)."""
        assert self._engine_steps is not None, "the flight has not started in the engine"
        async for step in self._engine_steps:
            self._record(step)
            yield step

    async def messages(
        self, render: Callable[[EngineStep], Sequence[Message]]
    ) -> AsyncIterator[Message]:
        """The messages `render` makes of each step, as a stream handler yields them to gRPC
        (the direct send's renderer makes the same message of a plain step).

        The generator resumes once gRPC has sent a message; a client that stops reading
        keeps it suspended at the yield, which the stall watchdog sees
        (`RequestTable.watch_stalled_streams`). It reads the engine's steps itself, not
        through `steps()`: one async-generator layer less per token.
        """
        assert self._engine_steps is not None, "the flight has not started in the engine"
        async for step in self._engine_steps:
            self._record(step)
            self._last_step = step
            for message in render(step):
                self.answering()
                yield message
                self.sending_since = None

    def _receive(self, token_ids: list[int], completion_tokens: int) -> bool:
        """The flight's receiver: a plain step, from the engine's output loop, rendered as
        the stream's next message and passed to the direct send; False (the engine buffers
        it) when the transport cannot take it now. The rule never gives a request's first
        step direct, so the task has rendered one (`_last_step`) before this runs."""
        direct, last = self._direct, self._last_step
        try:
            assert direct is not None and last is not None  # see above: never otherwise
            if not direct.send(direct.render(token_ids, last, completion_tokens)):
                return False
        except Exception:
            # This runs inside the engine's output loop, where an exception would fail the
            # engine: the task renders the step again and its error reaches this client.
            logger.exception("request %s: a direct send failed", self.request_id)
            return False
        now = time.monotonic()
        metrics = self._metrics
        if metrics is not None:
            metrics.generated_tokens.inc(len(token_ids))
            if self._last_sent is not None:
                metrics.time_between_messages.observe(now - self._last_sent)
        self._last_sent = now
        return True

    def answering(self) -> None:
        """A response message goes to gRPC now (also what a unary handler calls once)."""
        now = time.monotonic()
        if self.send_clock is None:
            self.sending_since = now
        metrics = self._metrics
        if metrics is not None:
            if self._last_sent is None:
                metrics.time_to_first_message.observe(now - self._started)
            else:
                metrics.time_between_messages.observe(now - self._last_sent)
        self._last_sent = now

    def _record(self, step: EngineStep) -> None:
        """Count what the engine produced; on the finished step, check how it ended."""
        metrics = self._metrics
        if metrics is not None and step.token_ids:
            metrics.generated_tokens.inc(len(step.token_ids))
        if step.finished:
            if metrics is not None:
                metrics.finish_reason.labels(step.finish_reason or "unknown").inc()
            if self.shut_down and step.finish_reason == "abort":
                raise EngineUnavailable(SHUT_DOWN)

    def stalled_since(self) -> float | None:
        """Since when a message of this request has waited for the client to take it."""
        clock = self.send_clock
        return self.sending_since if clock is None else clock.sending_since

    def finished(self) -> None:
        if self._metrics is not None:
            self._metrics.request_duration.observe(time.monotonic() - self._started)
