"""A request in flight: its engine steps, counted and checked, and its send accounting.

`Flight` is what `RequestTable.run` yields; handlers read steps from it, never from the
engine, so the bookkeeping every contract needs (token and finish counters, the timing
histograms, what the stall watchdog watches, a drain abort told as UNAVAILABLE) is here once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Protocol, TypeVar

from ..engine import EngineStep
from ..errors import EngineUnavailable
from .metrics import ServicerMetrics

Message = TypeVar("Message")

SHUT_DOWN = (
    "server shut down before the request finished (aborted after the drain grace period); "
    "retry on another worker"
)


class SendClock(Protocol):
    """Whatever sends a request's messages, seen by the stall watchdog."""

    sending_since: float | None


class Flight:
    """One admitted request: its engine steps, what the stall watchdog watches, its metrics.

    A handler takes the request's steps from here, already counted and checked
    (`steps`, or `messages` for a stream, which also does the send accounting), so
    no contract can forget that a drain abort is UNAVAILABLE, not an answer.
    """

    __slots__ = ("_engine_steps", "_last_sent", "_metrics", "_started", "failure",
                 "request_id", "send_clock", "sending_since", "shut_down", "task")  # fmt: skip

    def __init__(self, request_id: str, metrics: ServicerMetrics | None) -> None:
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
        self, render: Callable[[EngineStep], Iterable[Message]]
    ) -> AsyncIterator[Message]:
        """The messages `render` makes of each step, as a stream handler yields them to gRPC.

        The generator resumes once gRPC has sent a message; a client that stops reading
        keeps it suspended at the yield, which the stall watchdog sees
        (`RequestTable.watch_stalled_streams`). It reads the engine's steps itself, not
        through `steps()`: one async-generator layer less per token.
        """
        assert self._engine_steps is not None, "the flight has not started in the engine"
        async for step in self._engine_steps:
            self._record(step)
            for message in render(step):
                self.answering()
                yield message
                self.sending_since = None

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
