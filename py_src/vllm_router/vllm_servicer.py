"""VllmEngineServicer: the vllm.engine.v1.VllmEngine RPCs, thin handlers over shared parts.

Each handler converts (convert.py), runs the request through the shared request
table (serving/), and converts back; `rpc.handles_errors` maps what they raise to
status codes. `python -m vllm_router.vllm_servicer` runs the `vllm-servicer` CLI.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from . import convert
from .engine import AsyncEngine, LoadSnapshot
from .proto import vllm_engine_pb2 as pb
from .proto import vllm_engine_pb2_grpc as pb_grpc
from .rpc import handles_errors
from .serving import RequestTable, ServingState

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["VllmEngine"].full_name


class VllmEngineServicer(pb_grpc.VllmEngineServicer):
    def __init__(self, engine: AsyncEngine, requests: RequestTable, state: ServingState) -> None:
        self._engine = engine
        self._requests = requests
        self._state = state
        self._metrics_for: LoadSnapshot | None = None
        self._metrics = pb.WorkerMetrics()

    @handles_errors
    async def GenerateStream(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateStreamResponse]:
        generation = convert.to_generation_request(request, self._engine.facts)
        async with self._requests.run(generation) as flight:
            request_id = flight.request_id
            clock = asyncio.get_running_loop().time
            first = True
            async for step in flight.steps:
                if step.finished:
                    flight.check_finished(step)
                metrics = self._worker_metrics() if first or step.finished else None
                first = False
                message = convert.stream_message(request_id, step, metrics)
                # The generator resumes once gRPC has sent the message; a client that stops
                # reading keeps it suspended here (see RequestTable.watch_stalled_streams).
                flight.sending_since = clock()
                yield message
                flight.sending_since = None

    @handles_errors
    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> pb.GenerateResponse:
        generation = convert.to_generation_request(request, self._engine.facts)
        result = convert.UnaryAccumulator()
        async with self._requests.run(generation) as flight:
            async for step in flight.steps:
                result.add(step)
                if step.finished:
                    flight.check_finished(step)
        return result.response(generation.request_id, self._worker_metrics())

    @handles_errors
    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetModelInfoResponse:
        await self._state.require_engine()
        return convert.model_info(self._engine.facts)

    @handles_errors
    async def HealthCheck(
        self, request: pb.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> pb.HealthCheckResponse:
        status = await self._state.status()
        if status.serving:
            return pb.HealthCheckResponse(status=pb.HealthCheckResponse.SERVING)
        return pb.HealthCheckResponse(
            status=pb.HealthCheckResponse.NOT_SERVING, message=status.reason
        )

    @handles_errors
    async def ResetPrefixCache(
        self, request: pb.ResetPrefixCacheRequest, context: grpc.aio.ServicerContext
    ) -> pb.ResetPrefixCacheResponse:
        await self._state.require_engine()
        if await self._engine.reset_prefix_cache():
            return pb.ResetPrefixCacheResponse(success=True)
        load = self._engine.load()
        return pb.ResetPrefixCacheResponse(
            success=False,
            message=(
                "the engine refused to reset its prefix cache while requests hold cache "
                f"blocks ({len(self._requests.in_flight)} in flight here, "
                f"{load.running_requests} running in the engine); retry when idle"
            ),
        )

    def _worker_metrics(self) -> pb.WorkerMetrics:
        # The engine replaces its snapshot once per step; build the proto once per snapshot.
        load = self._engine.load()
        if load is not self._metrics_for:
            self._metrics_for = load
            self._metrics = convert.worker_metrics(load)
        return self._metrics


if __name__ == "__main__":
    from vllm_router.cli import main

    main()
