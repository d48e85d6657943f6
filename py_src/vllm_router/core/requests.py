"""The request table: every generation request in flight on this worker, whatever contract.

It owns the one request-id space (duplicates are ALREADY_EXISTS), the concurrency limit,
the drain (refuse new work, wait for idle, abort the rest), the watchdog that aborts
streams whose client stopped reading, and the engine call itself, so every contract's
handler is: convert, `async with table.run(request) as flight`, convert each of
`flight.messages(...)` / `flight.steps()` back. What a request must pass before it takes
a place here (model kind, serving state, prompt, media) is admission.py's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

from ..engine import AsyncEngine, DirectReceiver, Embedding, GenerationRequest
from ..errors import (
    DuplicateRequest,
    Overloaded,
)
from .admission import Admission
from .flight import DirectSend, Flight
from .health import ServingState
from .media_admission import MediaRules
from .metrics import ServicerMetrics

logger = logging.getLogger(__name__)


class RequestTable:
    def __init__(
        self,
        engine: AsyncEngine,
        state: ServingState,
        *,
        max_concurrent: int = 0,
        max_prompt_tokens: int = 0,
        log_requests: bool = False,
        metrics: ServicerMetrics | None = None,
        media_rules: MediaRules | None = None,
    ) -> None:
        self._engine = engine
        self._admission = Admission(
            engine,
            state,
            max_prompt_tokens=max_prompt_tokens,
            metrics=metrics,
            media_rules=media_rules,
        )
        self._metrics = metrics
        self._state = state
        self._max_concurrent = max_concurrent
        self._log_requests = log_requests
        self._flights: dict[str, Flight] = {}
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def in_flight(self) -> frozenset[str]:
        return frozenset(self._flights)

    @property
    def admission(self) -> Admission:
        """What a request passes in `run` (for a contract that needs a text prompt's ids
        before the request runs: `Admission.tokenized`, counted as `run`'s refusals are)."""
        return self._admission

    @contextlib.asynccontextmanager
    async def run(
        self,
        request: GenerationRequest,
        *,
        receiver: DirectReceiver | None = None,
        direct_send: DirectSend | None = None,
    ) -> AsyncIterator[Flight]:
        """Admit `request`, start it in the engine and yield its Flight (see its steps).

        The engine may give the request's plain steps direct instead of yielding them
        (engine/direct.py), to one of two, never both:
        - `receiver`: the caller's own (a batched stream's lane; what it takes is not
          counted here: the caller counts it, in bulk, with `count_generated`);
        - `direct_send`: the stream's, through which the flight sends each as the stream's
          next message itself (flight.py).

        Leaving the block (finished, cancelled, failed) closes the engine's iterator,
        which aborts the request in the engine if it is still running."""
        assert receiver is None or direct_send is None, "one receiver per request"
        request = await self._admission.generation(request)
        prompt_tokens = len(request.prompt_token_ids or ())
        async with self._admitted(request.request_id, prompt_tokens, direct_send) as flight:
            if self._log_requests:
                logger.info(
                    "request %s: %d prompt tokens, n=%s, dp_rank=%s, lora=%s",
                    request.request_id,
                    prompt_tokens,
                    request.sampling.n or 1,
                    request.dp_rank,
                    request.lora_name,
                )
            steps = self._engine.generate(request, receiver=receiver or flight.receiver)
            flight.begin(steps)
            try:
                yield flight
            finally:
                await steps.aclose()

    def count_generated(self, tokens: int) -> None:
        """Tokens that reached a client outside any Flight's steps (see `run`'s `receiver`)."""
        if self._metrics is not None:
            self._metrics.generated_tokens.inc(tokens)

    async def embed(self, request_id: str, prompt_token_ids: list[int]) -> Embedding:
        """Admit an embedding request (same id space, limits and drain) and run it."""
        await self._admission.embedding(prompt_token_ids)
        async with self._admitted(request_id, len(prompt_token_ids)):
            return await self._engine.embed(request_id, prompt_token_ids)

    async def abort(self, request_ids: list[str]) -> list[str]:
        """Abort those of `request_ids` in flight (every sample); returns which they were."""
        aborted = []
        for request_id in dict.fromkeys(request_ids):
            if request_id in self._flights:
                await self._engine.abort(request_id)
                aborted.append(request_id)
        return aborted

    @contextlib.asynccontextmanager
    async def _admitted(
        self, request_id: str, prompt_tokens: int, direct_send: DirectSend | None = None
    ) -> AsyncIterator[Flight]:
        async with self._admission.counted():
            if request_id in self._flights:
                raise DuplicateRequest(
                    f"request_id {request_id!r} is already in flight on this worker"
                )
            if self._max_concurrent and len(self._flights) >= self._max_concurrent:
                raise Overloaded(
                    f"this worker already runs {len(self._flights)} requests "
                    f"(--max-concurrent-streams {self._max_concurrent}); retry on another worker"
                )
        flight = Flight(request_id, self._metrics, direct_send)
        if self._metrics is not None:
            self._metrics.prompt_tokens.inc(prompt_tokens)
        self._flights[request_id] = flight
        self._idle.clear()
        try:
            yield flight
        except asyncio.CancelledError:
            if flight.failure is None:
                raise
            task = asyncio.current_task()
            if task is not None and hasattr(task, "uncancel"):  # Python 3.11+
                task.uncancel()
            raise flight.failure from None
        finally:
            del self._flights[request_id]
            flight.finished()
            if not self._flights:
                self._idle.set()

    # -- drain ------------------------------------------------------------------------------------

    def start_draining(self) -> None:
        """Refuse new generation requests (UNAVAILABLE); in-flight ones continue."""
        self._state.start_draining()

    async def wait_idle(self, timeout: float | None) -> bool:
        """Wait until no request is in flight; False if `timeout` passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    async def abort_all(self) -> None:
        """Abort every request in flight; their RPCs end UNAVAILABLE (see Flight)."""
        for flight in list(self._flights.values()):
            flight.shut_down = True
            await self._engine.abort(flight.request_id)

    def fail_all(self, failure: Exception) -> None:
        """End every request in flight with `failure` (an error its client is told), now:
        for an engine that answers nothing, not even an abort."""
        for flight in list(self._flights.values()):
            if flight.task is not None and flight.failure is None:
                flight.failure = failure
                flight.task.cancel()

    # -- stalled readers --------------------------------------------------------------------------

    async def watch_stalled_streams(self, stall_timeout: float) -> None:
        """Cancel streams whose client stopped reading (a send blocked by flow control).

        Cancelling the RPC closes the engine's iterator, which aborts the request in
        the engine: nothing keeps decoding for a client that no longer reads.
        """
        while True:
            await asyncio.sleep(min(1.0, stall_timeout / 4))
            now = time.monotonic()
            for flight in list(self._flights.values()):
                since = flight.stalled_since()
                if since is not None and now - since > stall_timeout and flight.task is not None:
                    logger.warning(
                        "request %s: client has not read for %.1fs; aborting",
                        flight.request_id,
                        now - since,
                    )
                    flight.task.cancel()
