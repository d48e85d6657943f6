"""VllmEngineServicer: the five vllm.engine.v1.VllmEngine RPCs over an AsyncEngine.

Handlers stay thin: conversion and validation live in convert.py, status codes
in errors.py, the engine behind the AsyncEngine protocol. Generate and
GenerateStream share one implementation (`_run`) and one request table.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable

import grpc

from . import convert
from .engine import AsyncEngine, EngineStep, LoadSnapshot
from .errors import DuplicateRequest, EngineUnavailable, Malformed, Overloaded, status_for
from .proto import vllm_engine_pb2 as pb
from .proto import vllm_engine_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["VllmEngine"].full_name


class _Flight:
    """One request in flight: the RPC task and, while a message is being sent, since when."""

    __slots__ = ("sending_since", "task")

    def __init__(self, task: asyncio.Task | None) -> None:
        self.task = task
        self.sending_since: float | None = None


async def _fail(context: grpc.aio.ServicerContext, exc: Exception) -> None:
    code, message = status_for(exc)
    if code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN):
        logger.error("RPC failed unexpectedly", exc_info=exc)
    await context.abort(code, message)


class VllmEngineServicer(pb_grpc.VllmEngineServicer):
    def __init__(
        self,
        engine: AsyncEngine,
        *,
        on_engine_dead: Callable[[], None] | None = None,
        log_requests: bool = False,
        max_concurrent_streams: int = 0,
        max_prompt_tokens: int = 0,
    ) -> None:
        self._engine = engine
        self._on_engine_dead = on_engine_dead
        self._log_requests = log_requests
        self._max_concurrent = max_concurrent_streams
        self._max_prompt_tokens = max_prompt_tokens
        self._in_flight: dict[str, _Flight] = {}
        self._idle = asyncio.Event()
        self._idle.set()
        self._draining = False
        self._metrics_for: LoadSnapshot | None = None
        self._metrics = pb.WorkerMetrics()

    # -- lifecycle hooks used by server.py --------------------------------------------------------

    @property
    def in_flight(self) -> frozenset[str]:
        return frozenset(self._in_flight)

    @property
    def draining(self) -> bool:
        return self._draining

    def start_draining(self) -> None:
        """Refuse new generation requests (UNAVAILABLE); in-flight ones continue."""
        self._draining = True

    async def wait_idle(self, timeout: float | None) -> bool:
        """Wait until no request is in flight; False if `timeout` passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    async def abort_all(self) -> None:
        for request_id in list(self._in_flight):
            await self._engine.abort(request_id)

    async def watch_stalled_streams(self, stall_timeout: float) -> None:
        """Cancel streams whose client stopped reading (a send blocked by flow control).

        Cancelling the RPC closes the engine's iterator, which aborts the request in
        the engine: nothing keeps decoding for a client that no longer reads.
        """
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(min(1.0, stall_timeout / 4))
            now = loop.time()
            for request_id, flight in list(self._in_flight.items()):
                since = flight.sending_since
                if since is not None and now - since > stall_timeout and flight.task is not None:
                    logger.warning(
                        "request %s: client has not read for %.1fs; aborting",
                        request_id,
                        now - since,
                    )
                    flight.task.cancel()

    # -- RPCs -------------------------------------------------------------------------------------

    async def GenerateStream(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateStreamResponse]:
        try:
            first = True
            async with self._run(request) as (request_id, steps):
                flight = self._in_flight[request_id]
                clock = asyncio.get_running_loop().time
                async for step in steps:
                    if step.finished:
                        self._check_not_shut_down(step)
                    metrics = self._worker_metrics() if first or step.finished else None
                    first = False
                    message = convert.stream_message(request_id, step, metrics)
                    # The generator resumes once gRPC has sent the message; a client that
                    # stops reading keeps it suspended here (see watch_stalled_streams).
                    flight.sending_since = clock()
                    yield message
                    flight.sending_since = None
        except Exception as exc:
            await _fail(context, exc)

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> pb.GenerateResponse:
        try:
            result = convert.UnaryAccumulator()
            async with self._run(request) as (request_id, steps):
                async for step in steps:
                    result.add(step)
                    if step.finished:
                        self._check_not_shut_down(step)
            return result.response(request_id, self._worker_metrics())
        except Exception as exc:
            await _fail(context, exc)
            raise  # unreachable: abort() raises

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetModelInfoResponse:
        try:
            self._require_live_engine()
            return convert.model_info(self._engine.facts)
        except Exception as exc:
            await _fail(context, exc)
            raise

    async def HealthCheck(
        self, request: pb.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> pb.HealthCheckResponse:
        status = pb.HealthCheckResponse
        if self._draining:
            return status(status=status.NOT_SERVING, message="server is draining (shutting down)")
        try:
            await self._engine.check_health()
        except EngineUnavailable as exc:
            return status(status=status.NOT_SERVING, message=exc.message)
        return status(status=status.SERVING)

    async def ResetPrefixCache(
        self, request: pb.ResetPrefixCacheRequest, context: grpc.aio.ServicerContext
    ) -> pb.ResetPrefixCacheResponse:
        try:
            self._require_live_engine()
            if await self._engine.reset_prefix_cache():
                return pb.ResetPrefixCacheResponse(success=True)
            load = self._engine.load()
            return pb.ResetPrefixCacheResponse(
                success=False,
                message=(
                    "the engine refused to reset its prefix cache while requests hold cache "
                    f"blocks ({len(self._in_flight)} in flight here, {load.running_requests} "
                    "running in the engine); retry when idle"
                ),
            )
        except Exception as exc:
            await _fail(context, exc)
            raise

    # -- shared generation path -------------------------------------------------------------------

    def _require_live_engine(self) -> None:
        if self._engine.errored:
            if self._on_engine_dead is not None:
                self._on_engine_dead()
            raise EngineUnavailable(
                "the engine is dead; this worker cannot serve (retry elsewhere)"
            )

    @contextlib.asynccontextmanager
    async def _run(
        self, request: pb.GenerateRequest
    ) -> AsyncIterator[tuple[str, AsyncGenerator[EngineStep, None]]]:
        if isinstance(request, Malformed):
            raise request.invalid()
        if self._draining:
            raise EngineUnavailable("server is draining (shutting down); retry on another worker")
        self._require_live_engine()
        generation = convert.to_generation_request(
            request, self._engine.facts, max_prompt_tokens=self._max_prompt_tokens
        )
        request_id = generation.request_id
        if request_id in self._in_flight:
            raise DuplicateRequest(f"request_id {request_id!r} is already in flight on this worker")
        if self._max_concurrent and len(self._in_flight) >= self._max_concurrent:
            raise Overloaded(
                f"this worker already runs {len(self._in_flight)} requests "
                f"(--max-concurrent-streams {self._max_concurrent}); retry on another worker"
            )
        self._in_flight[request_id] = _Flight(asyncio.current_task())
        self._idle.clear()
        if self._log_requests:
            logger.info(
                "request %s: %s prompt tokens, dp_rank=%s",
                request_id,
                len(generation.prompt_token_ids or ()) or "text",
                generation.dp_rank,
            )
        steps = self._engine.generate(generation)
        try:
            yield request_id, steps
        except EngineUnavailable:
            if self._engine.errored and self._on_engine_dead is not None:
                self._on_engine_dead()
            raise
        finally:
            # Closing the engine's iterator early (client cancel, deadline,
            # error) aborts the request inside the engine.
            await steps.aclose()
            del self._in_flight[request_id]
            if not self._in_flight:
                self._idle.set()

    def _check_not_shut_down(self, step: EngineStep) -> None:
        if step.finish_reason == "abort" and self._draining:
            raise EngineUnavailable(
                "server shut down before the request finished (aborted after the drain "
                "grace period); retry on another worker"
            )

    def _worker_metrics(self) -> pb.WorkerMetrics:
        # The engine replaces its snapshot once per step; build the proto once per snapshot.
        load = self._engine.load()
        if load is not self._metrics_for:
            self._metrics_for = load
            self._metrics = convert.worker_metrics(load)
        return self._metrics


def main() -> None:
    """`python -m vllm_router.vllm_servicer` and the `vllm-servicer` script."""
    from .cli import main as cli_main

    cli_main()


if __name__ == "__main__":
    main()
