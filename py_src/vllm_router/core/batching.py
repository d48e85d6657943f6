"""Many requests on one stream: the serving side of a batched generation RPC.

A single-request stream pays gRPC's per-message cost (a write batch, a completion, a
loop wake-up, a socket write: ~30 µs here) once per token per request. A router holds
one connection per worker anyway, so a contract may offer one stream that carries many
requests; its handler hands each request to a `BatchSession` and sends, one message
each, what `BatchSession.sends` yields: what the session's `Outbox` collected since the
last message, whenever it has news.

One message per engine step falls out of asyncio's ordering: the engine's output
handler wakes every request of a step before it yields, each request's task renders
its news into the outbox, and the sender (woken by the first of them) runs after them
all. A request waits until the message holding its news is sent before it takes its
next step (the steps merge meanwhile, as on a single-request stream), so a client that
reads slowly is sent fewer, larger messages and never makes the engine wait.

Every request goes through the request table exactly as a single-request stream does:
the same admission checks and limits, request-id space, drain, stall watchdog and
metrics. What differs is only how its end is told: an error ends that request alone
(an error entry, the stream goes on), and leaving the stream aborts every request
still on it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Generic, TypeVar

import grpc

from ..engine import EngineStep, GenerationRequest
from .health import ServingState
from .requests import RequestTable
from .servicer import failure_status

Update = TypeVar("Update")
Error = TypeVar("Error")

# Renders one step of a request (request id, step, is it the request's first message).
Render = Callable[[str, EngineStep, bool], Update]
# Builds the entry that tells a request's error (request id, status code, message, and
# whether it was refused before admission: another request may hold that id).
RenderError = Callable[[str, grpc.StatusCode, str, bool], Error]
# Counts how each request ended (its status code), as RPCs are counted.
CountOutcome = Callable[[grpc.StatusCode], None]

STALLED = "the client stopped reading this stream; the request was aborted"


class Outbox(Generic[Update, Error]):
    """What the requests of one session have to say since the last message was sent."""

    def __init__(self) -> None:
        self._updates: list[Update] = []
        self._errors: list[Error] = []
        self._news = asyncio.Event()
        # Set once the message holding what was put since the last take has been sent.
        self._sent = asyncio.Event()

    async def put(self, update: Update) -> None:
        """Add an update and wait until the message carrying it is sent."""
        self._updates.append(update)
        self._news.set()
        await self._sent.wait()

    def put_error(self, error: Error) -> None:
        """Add an error entry (nothing waits on it: the request has ended)."""
        self._errors.append(error)
        self._news.set()

    def poke(self) -> None:
        """Wake the sender without news (a request ended; maybe the session has)."""
        self._news.set()

    async def wait(self) -> None:
        await self._news.wait()
        self._news.clear()

    def take(self) -> tuple[list[Update], list[Error], asyncio.Event] | None:
        """Everything collected, and the event to set once it is sent; None if empty."""
        if not self._updates and not self._errors:
            return None
        taken = self._updates, self._errors, self._sent
        self._updates, self._errors, self._sent = [], [], asyncio.Event()
        return taken


class BatchSession(Generic[Update, Error]):
    """The requests of one batched stream, each in a task of its own."""

    def __init__(
        self,
        table: RequestTable,
        state: ServingState,
        render: Render[Update],
        render_error: RenderError[Error],
        count: CountOutcome | None = None,
    ) -> None:
        self._table = table
        self._state = state
        self._render = render
        self._render_error = render_error
        self._count = count
        self.outbox: Outbox[Update, Error] = Outbox()
        self._running: dict[str, asyncio.Task[None]] = {}
        self._timed_out: set[str] = set()
        self._closing = False

    @property
    def running(self) -> frozenset[str]:
        return frozenset(self._running)

    def start(self, request_id: str, generation: GenerationRequest, timeout: float) -> None:
        """Run `generation` (its id checked by the caller); `timeout` seconds, 0 for none."""
        if request_id in self._running:
            # The table would say so too, but this id's task must not be replaced.
            message = f"request_id {request_id!r} is already in flight on this stream"
            self.fail(request_id, grpc.StatusCode.ALREADY_EXISTS, message, refused=True)
            return
        task = asyncio.create_task(self._run(request_id, generation), name=f"batch:{request_id}")
        self._running[request_id] = task
        if timeout > 0:
            handle = asyncio.get_running_loop().call_later(timeout, self._expire, request_id, task)
            task.add_done_callback(lambda _: handle.cancel())

    def fail(self, request_id: str, code: grpc.StatusCode, message: str, *, refused: bool) -> None:
        """Tell a request's error: `refused` before admission, or the end of an admitted one."""
        self.outbox.put_error(self._render_error(request_id, code, message, refused))
        if self._count is not None:
            self._count(code)

    async def abort(self, request_ids: list[str]) -> None:
        """Abort those of `request_ids` running on this stream (others are not ours)."""
        await self._table.abort([r for r in request_ids if r in self._running])

    async def sends(
        self, reading: asyncio.Task[None]
    ) -> AsyncIterator[tuple[list[Update], list[Error]]]:
        """What to send, message by message, until `reading` (the task that reads the
        client's requests into this session) is done and every request has ended.

        The caller sends each before asking for the next (the requests that put news in it
        wait until then). Leaving early (the client went away) cancels `reading` and every
        request still running, which aborts each in the engine.
        """
        try:
            while True:
                taken = self.outbox.take()
                if taken is None:
                    if reading.done() and not self._running:
                        reading.result()  # a failure reading the stream is the RPC's
                        return
                    await self.outbox.wait()
                    continue
                updates, errors, sent = taken
                yield updates, errors
                sent.set()
        finally:
            reading.cancel()
            await self.close()

    async def close(self) -> None:
        """Cancel every request still running (the engine aborts each) and wait for them."""
        self._closing = True
        tasks = list(self._running.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _expire(self, request_id: str, task: asyncio.Task[None]) -> None:
        self._timed_out.add(request_id)
        task.cancel()

    async def _run(self, request_id: str, generation: GenerationRequest) -> None:
        started = False  # has the engine produced anything for it (else it was refused)
        try:
            async with self._table.run(generation) as flight:
                async for step in flight.steps():
                    update = self._render(request_id, step, not started)
                    started = True
                    flight.answering()
                    await self.outbox.put(update)
                    flight.sending_since = None
            if self._count is not None:
                self._count(grpc.StatusCode.OK)
        except asyncio.CancelledError:
            if self._closing:
                raise
            # Not the session's doing: this request's deadline, or the stall watchdog
            # (the client stopped reading). The request has left the engine; say why.
            if request_id in self._timed_out:
                message = "the request did not finish within its timeout_ms"
                self.fail(request_id, grpc.StatusCode.DEADLINE_EXCEEDED, message, refused=False)
            else:
                self.fail(request_id, grpc.StatusCode.CANCELLED, STALLED, refused=False)
        except Exception as exc:
            code, message = await failure_status(self._state, exc)
            self.fail(request_id, code, message, refused=not started)
        finally:
            del self._running[request_id]
            self._timed_out.discard(request_id)
            self.outbox.poke()
