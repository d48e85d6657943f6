"""Many requests on one stream: the serving side of a batched generation RPC.

A single-request stream pays gRPC's per-message cost (a write batch, a completion, a
loop wake-up, a socket write) once per token per request. A router holds
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

A request's plain steps (new token ids, nothing else) need none of that: the engine
gives them direct to the request's `Lane` (its receiver, engine/direct.py) from its
output loop while the request's task waits for something else (its finish), and the lane
appends them to the outbox's pending message. No task wakes, no step object is built, and
steps that arrive while a message is being sent merge into the next one. The task still
takes the first step, the last, errors and anything else, and claims what its lane holds
before it renders, so a request's tokens stay in order.

Every request goes through the request table exactly as a single-request stream does:
the same admission checks and limits, request-id space, drain, stall watchdog and
metrics. What differs is only how its end is told: an error ends that request alone
(an error entry, the stream goes on), and leaving the stream aborts every request
still on it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Generic, TypeVar

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


class Lane:
    """A batched stream's receiver for one request: where the engine gives its plain steps
    direct (engine/direct.py).

    Called from inside the engine's output loop, once per request per step: it only
    appends (the first tokens since the last message also queue the lane in the outbox).
    The counts are the request's usage as of its latest tokens (the engine's, told with
    each step), for a renderer that sends them in GenerateStream's shape.
    """

    __slots__ = ("_outbox", "cached_tokens", "compact", "completion_tokens", "prompt_tokens",
                 "request_id", "token_ids")  # fmt: skip

    def __init__(self, request_id: str, outbox: Outbox[Any, Any], compact: bool) -> None:
        self.request_id = request_id
        self.compact = compact
        self.token_ids: list[int] = []
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.cached_tokens = 0
        self._outbox = outbox

    def __call__(self, token_ids: list[int], completion_tokens: int) -> bool:
        """Always takes them: they leave with the outbox's next message."""
        if self.token_ids:
            self.token_ids += token_ids
        else:
            self.token_ids = [*token_ids]  # the engine's list is not ours to extend
            self._outbox.queue(self)
        self.completion_tokens = completion_tokens
        return True

    def claim(self, step: EngineStep) -> EngineStep:
        """`step` with what this lane holds unsent in front of its tokens, and the counts
        updated from it (the task's step comes after whatever the lane took)."""
        self.prompt_tokens = step.prompt_tokens
        self.completion_tokens = step.completion_tokens
        self.cached_tokens = step.cached_tokens
        if not self.token_ids:
            return step
        earlier = self._outbox.unqueue(self)
        return dataclasses.replace(step, token_ids=earlier + step.token_ids)

    def take(self) -> list[int]:
        taken, self.token_ids = self.token_ids, []
        return taken


@dataclasses.dataclass(slots=True)
class Message(Generic[Update, Error]):
    """One outgoing message's contents: updates, errors, and lanes with their new tokens."""

    updates: list[Update]
    errors: list[Error]
    lanes: list[Lane]
    lane_tokens: list[list[int]]  # lane_tokens[i]: lanes[i]'s tokens in this message

    @property
    def token_count(self) -> int:
        return sum(map(len, self.lane_tokens))


class Outbox(Generic[Update, Error]):
    """What the requests of one session have to say since the last message was sent."""

    def __init__(self, count_tokens: Callable[[int], None] | None = None) -> None:
        """`count_tokens`: told how many lane tokens leave, in a message or claimed."""
        self._count_tokens = count_tokens
        self._updates: list[Update] = []
        self._errors: list[Error] = []
        self._lanes: dict[str, Lane] = {}  # lanes with tokens, in arrival order
        self._news = asyncio.Event()
        # Set once the message holding what was put since the last take has been sent.
        self._sent = asyncio.Event()
        # Monotonic time since which a message has been waiting for the client to take it
        # (what the stall watchdog reads for every request of the session).
        self.sending_since: float | None = None

    async def put(self, update: Update) -> None:
        """Add an update and wait until the message carrying it is sent."""
        self._updates.append(update)
        self._news.set()
        await self._sent.wait()

    def put_error(self, error: Error) -> None:
        """Add an error entry (nothing waits on it: the request has ended)."""
        self._errors.append(error)
        self._news.set()

    def queue(self, lane: Lane) -> None:
        """A lane has tokens for the next message."""
        self._lanes[lane.request_id] = lane
        self._news.set()

    def unqueue(self, lane: Lane) -> list[int]:
        """The lane's tokens, claimed by its request's task (they leave with its update)."""
        self._lanes.pop(lane.request_id, None)
        claimed = lane.take()
        if self._count_tokens is not None:
            self._count_tokens(len(claimed))
        return claimed

    def poke(self) -> None:
        """Wake the sender without news (a request ended; maybe the session has)."""
        self._news.set()

    async def wait(self) -> None:
        await self._news.wait()
        self._news.clear()

    def take(self) -> tuple[Message[Update, Error], asyncio.Event] | None:
        """Everything collected, and the event to set once it is sent; None if empty."""
        if not self._updates and not self._errors and not self._lanes:
            return None
        lanes = list(self._lanes.values())
        message = Message(self._updates, self._errors, lanes, [lane.take() for lane in lanes])
        if lanes and self._count_tokens is not None:
            self._count_tokens(message.token_count)
        taken = message, self._sent
        self._updates, self._errors, self._lanes, self._sent = [], [], {}, asyncio.Event()
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
        self.outbox: Outbox[Update, Error] = Outbox(table.count_generated)
        self._running: dict[str, asyncio.Task[None]] = {}
        self._timed_out: set[str] = set()
        self._closing = False

    def start(
        self,
        request_id: str,
        generation: GenerationRequest,
        timeout: float,
        *,
        compact: bool = False,
    ) -> None:
        """Run `generation` (its id checked by the caller); `timeout` seconds, 0 for none;
        `compact`: its lane's tokens are rendered in the compact shape."""
        if request_id in self._running:
            # The table would say so too, but this id's task must not be replaced.
            message = f"request_id {request_id!r} is already in flight on this stream"
            self.fail(request_id, grpc.StatusCode.ALREADY_EXISTS, message, refused=True)
            return
        lane = Lane(request_id, self.outbox, compact)
        task = asyncio.create_task(
            self._run(request_id, generation, lane), name=f"batch:{request_id}"
        )
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

    async def sends(self, reading: asyncio.Task[None]) -> AsyncIterator[Message[Update, Error]]:
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
                message, sent = taken
                self.outbox.sending_since = time.monotonic()
                yield message
                self.outbox.sending_since = None
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

    async def _run(self, request_id: str, generation: GenerationRequest, lane: Lane) -> None:
        started = False  # has the engine produced anything for it (else it was refused)
        try:
            async with self._table.run(generation, receiver=lane) as flight:
                # The session's sender is what a stalled client blocks.
                flight.send_clock = self.outbox
                async for step in flight.steps():
                    update = self._render(request_id, lane.claim(step), not started)
                    started = True
                    flight.answering()
                    await self.outbox.put(update)
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
