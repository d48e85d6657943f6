"""VllmEngineServicer: the vllm.engine.v1.VllmEngine RPCs, thin handlers over shared parts.

Each handler converts (convert.py), runs the request through the shared request
table (serving/), and converts back (responses.py); `rpc.handles_errors` maps what
they raise to status codes. `python -m vllm_router.vllm_servicer` runs the CLI.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TypeAlias

import grpc

from . import convert, responses
from .contract import tokenizer_digest
from .engine import GenerationRequest, LoadSnapshot
from .errors import InvalidRequest, Unsupported
from .proto import vllm_engine_pb2 as pb
from .proto import vllm_engine_pb2_grpc as pb_grpc
from .rpc import ContractServicer, handles_errors

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["VllmEngine"].full_name
Context: TypeAlias = grpc.aio.ServicerContext


class VllmEngineServicer(ContractServicer, pb_grpc.VllmEngineServicer):
    service_label = SERVICE_NAME
    # Per-instance caches, set on first use (immutable defaults).
    _metrics_for: LoadSnapshot | None = None
    _metrics: pb.WorkerMetrics
    _tokenizer_sha256: str | None = None

    def _generation(self, request: pb.GenerateRequest, context: Context) -> GenerationRequest:
        trace = convert.trace_headers(context.invocation_metadata())
        return convert.to_generation_request(request, self._engine.facts, trace)

    @handles_errors
    async def GenerateStream(
        self, request: pb.GenerateRequest, context: Context
    ) -> AsyncIterator[pb.GenerateStreamResponse]:
        generation = self._generation(request, context)
        async with self._requests.run(generation) as (flight, steps):
            request_id = flight.request_id
            first = True
            async for step in steps:
                flight.step(step)
                metrics = self._worker_metrics() if first or step.finished else None
                first = False
                message = responses.stream_message(request_id, step, metrics)
                # The generator resumes once gRPC has sent the message; a client that stops
                # reading keeps it suspended here (see RequestTable.watch_stalled_streams).
                flight.sending()
                yield message
                flight.sent()

    @handles_errors
    async def Generate(self, request: pb.GenerateRequest, context: Context) -> pb.GenerateResponse:
        generation = self._generation(request, context)
        result = responses.UnaryAccumulator()
        async with self._requests.run(generation) as (flight, steps):
            async for step in steps:
                flight.step(step)
                result.add(step)
            flight.sending()
        return result.response(generation.request_id, self._worker_metrics())

    @handles_errors
    async def Embed(self, request: pb.EmbedRequest, context: Context) -> pb.EmbedResponse:
        request_id = convert.checked_request_id(request.request_id)
        result = await self._requests.embed(request_id, list(request.prompt_token_ids))
        return responses.embedding(request_id, result)

    @handles_errors
    async def Abort(self, request: pb.AbortRequest, context: Context) -> pb.AbortResponse:
        aborted = await self._requests.abort(list(request.request_ids))
        return pb.AbortResponse(aborted_request_ids=aborted)

    @handles_errors
    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: Context
    ) -> pb.GetModelInfoResponse:
        await self._state.require_engine()
        facts = self._engine.facts
        adapters = await self._engine.list_lora_adapters() if facts.supports_lora else []
        if self._tokenizer_sha256 is None:  # the files do not change while serving
            try:
                files = await self._engine.tokenizer_files()
                self._tokenizer_sha256 = tokenizer_digest(files)
            except Unsupported:  # an engine without tokenizer files (the mock)
                self._tokenizer_sha256 = ""
        return responses.model_info(facts, adapters, self._tokenizer_sha256)

    @handles_errors
    async def GetLoads(self, request: pb.GetLoadsRequest, context: Context) -> pb.GetLoadsResponse:
        await self._state.require_engine()
        return responses.loads(self._engine.loads(), len(self._requests.in_flight))

    @handles_errors
    async def GetTokenizer(
        self, request: pb.GetTokenizerRequest, context: Context
    ) -> AsyncIterator[pb.GetTokenizerResponse]:
        await self._state.require_engine()
        for chunk in responses.tokenizer_chunks(await self._engine.tokenizer_files()):
            yield chunk

    @handles_errors
    async def HealthCheck(
        self, request: pb.HealthCheckRequest, context: Context
    ) -> pb.HealthCheckResponse:
        status = await self._state.status()
        if status.serving:
            return pb.HealthCheckResponse(status=pb.HealthCheckResponse.SERVING)
        return pb.HealthCheckResponse(
            status=pb.HealthCheckResponse.NOT_SERVING, message=status.reason
        )

    @handles_errors
    async def ResetPrefixCache(
        self, request: pb.ResetPrefixCacheRequest, context: Context
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

    @handles_errors
    async def ListLoraAdapters(
        self, request: pb.ListLoraAdaptersRequest, context: Context
    ) -> pb.ListLoraAdaptersResponse:
        await self._state.require_engine()
        return responses.lora_adapters(await self._engine.list_lora_adapters())

    @handles_errors
    async def LoadLoraAdapter(
        self, request: pb.LoadLoraAdapterRequest, context: Context
    ) -> pb.LoadLoraAdapterResponse:
        await self._state.require_engine()
        if not request.name or not request.path:
            raise InvalidRequest("LoadLoraAdapter needs both a name and a path")
        await self._engine.load_lora_adapter(request.name, request.path)
        return pb.LoadLoraAdapterResponse()

    @handles_errors
    async def UnloadLoraAdapter(
        self, request: pb.UnloadLoraAdapterRequest, context: Context
    ) -> pb.UnloadLoraAdapterResponse:
        await self._state.require_engine()
        await self._engine.unload_lora_adapter(request.name)
        return pb.UnloadLoraAdapterResponse()

    def _worker_metrics(self) -> pb.WorkerMetrics:
        # The engine replaces its snapshot once per step; build the proto once per snapshot.
        load = self._engine.load()
        if load is not self._metrics_for:
            self._metrics_for = load
            self._metrics = responses.worker_metrics(load)
        return self._metrics


if __name__ == "__main__":
    from vllm_router.cli import main

    main()
