"""The request table: every generation request in flight on this worker, whatever contract.

It owns the one request-id space (duplicates are ALREADY_EXISTS), the admission limits,
the drain (refuse new work, wait for idle, abort the rest), the watchdog that aborts
streams whose client stopped reading, and the engine call itself, so every contract's
handler is: convert, `async with table.run(request) as flight`, convert each of
`flight.messages(...)` / `flight.steps()` back.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator

from ..engine import AsyncEngine, Embedding, GenerationRequest
from ..errors import (
    DuplicateRequest,
    InvalidRequest,
    NotConfigured,
    Overloaded,
    ServicerError,
)
from .flight import Flight
from .health import ServingState
from .media import MediaRules, resolve_media
from .metrics import ServicerMetrics
from .prompts import check_prompt

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
        self._media_rules = media_rules or MediaRules.of(engine.facts)
        self._metrics = metrics
        self._state = state
        self._max_concurrent = max_concurrent
        self._max_prompt_tokens = max_prompt_tokens
        self._log_requests = log_requests
        self._flights: dict[str, Flight] = {}
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def in_flight(self) -> frozenset[str]:
        return frozenset(self._flights)

    @contextlib.asynccontextmanager
    async def run(self, request: GenerationRequest) -> AsyncIterator[Flight]:
        """Admit `request`, start it in the engine and yield its Flight (see its steps).

        Leaving the block (finished, cancelled, failed) closes the engine's iterator,
        which aborts the request in the engine if it is still running."""
        async with self._rejections_counted():
            if not self._engine.facts.is_generation:
                raise NotConfigured(
                    "this worker serves a pooling (embedding) model: use Embed, not generation"
                )
            await self._state.require_serving()
            request = await self._with_checked_prompt(request)
        prompt_tokens = len(request.prompt_token_ids or ())
        async with self._admitted(request.request_id, prompt_tokens) as flight:
            if self._log_requests:
                logger.info(
                    "request %s: %d prompt tokens, n=%s, dp_rank=%s, lora=%s",
                    request.request_id,
                    prompt_tokens,
                    request.sampling.n or 1,
                    request.dp_rank,
                    request.lora_name,
                )
            steps = self._engine.generate(request)
            flight.begin(steps)
            try:
                yield flight
            finally:
                await steps.aclose()

    async def embed(self, request_id: str, prompt_token_ids: list[int]) -> Embedding:
        """Admit an embedding request (same id space, limits and drain) and run it."""
        async with self._rejections_counted():
            if self._engine.facts.is_generation:
                raise NotConfigured(
                    "this worker serves a generation model: Embed needs a pooling model "
                    "(start the engine with --runner pooling, or --convert embed)"
                )
            await self._state.require_serving()
            check_prompt(
                prompt_token_ids,
                None,
                self._engine.facts,
                max_prompt_tokens=self._max_prompt_tokens,
            )
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
    async def _rejections_counted(self) -> AsyncIterator[None]:
        try:
            yield
        except ServicerError as exc:
            if self._metrics is not None:
                self._metrics.reject(exc)
            raise

    @contextlib.asynccontextmanager
    async def _admitted(self, request_id: str, prompt_tokens: int) -> AsyncIterator[Flight]:
        async with self._rejections_counted():
            if request_id in self._flights:
                raise DuplicateRequest(
                    f"request_id {request_id!r} is already in flight on this worker"
                )
            if self._max_concurrent and len(self._flights) >= self._max_concurrent:
                raise Overloaded(
                    f"this worker already runs {len(self._flights)} requests "
                    f"(--max-concurrent-streams {self._max_concurrent}); retry on another worker"
                )
        flight = Flight(request_id, self._metrics)
        if self._metrics is not None:
            self._metrics.prompt_tokens.inc(prompt_tokens)
        self._flights[request_id] = flight
        self._idle.clear()
        try:
            yield flight
        finally:
            del self._flights[request_id]
            flight.finished()
            if not self._flights:
                self._idle.set()

    async def _with_checked_prompt(self, request: GenerationRequest) -> GenerationRequest:
        if request.prompt_token_ids is None:
            ids = await self._engine.tokenize(request.prompt_text or "")
            request = dataclasses.replace(request, prompt_token_ids=ids, prompt_text=None)
            field_name = "prompt_text (tokenized)"
        else:
            field_name = request.prompt_field
        try:
            check_prompt(
                request.prompt_token_ids or [],
                None if request.fill_context else request.sampling.max_tokens,
                self._engine.facts,
                max_prompt_tokens=self._max_prompt_tokens,
                field_name=field_name,
            )
        except InvalidRequest:
            # vLLM validates sampling values before the prompt: a request wrong in both
            # is told about its sampling (only failing requests pay for this check).
            self._engine.check_sampling(request)
            raise
        # Media URLs are fetched last: a request refused for its prompt costs no download.
        return await resolve_media(request, self._engine.facts, self._media_rules)

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
                since = flight.sending_since
                if since is not None and now - since > stall_timeout and flight.task is not None:
                    logger.warning(
                        "request %s: client has not read for %.1fs; aborting",
                        flight.request_id,
                        now - since,
                    )
                    flight.task.cancel()
