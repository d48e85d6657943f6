"""VllmEngineServicer: the vllm.engine.v1.VllmEngine RPCs, thin handlers over the serving core.

Each handler converts (convert.py), runs the request through the core's request
table, and converts back (responses.py); `core.handles_errors` maps what they raise
to status codes.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from typing import TypeAlias

import grpc

from ...core import ContractServicer, Malformed, failure_status, handles_errors
from ...core.accumulate import RequestResult
from ...core.batching import BatchSession
from ...core.request_fields import checked_request_id, request_trace, trace_headers
from ...engine import EngineStep, GenerationRequest, LoadSnapshot
from ...errors import InvalidRequest, Unsupported
from ...proto import vllm_engine_pb2 as pb
from ...proto import vllm_engine_pb2_grpc as pb_grpc
from . import convert, responses
from .rules import tokenizer_digest

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["VllmEngine"].full_name
Context: TypeAlias = grpc.aio.ServicerContext
Session: TypeAlias = BatchSession[pb.GenerateStreamResponse, pb.RequestError]


class VllmEngineServicer(ContractServicer, pb_grpc.VllmEngineServicer):
    service_label = SERVICE_NAME
    control_rpcs = frozenset(
        {"ResetPrefixCache", "LoadLoraAdapter", "UnloadLoraAdapter", "ListLoraAdapters"}
    )
    router_rpcs = frozenset(
        {
            "GenerateStream", "GenerateBatch", "Generate", "Embed", "Abort", "GetModelInfo",
            "GetLoads", "GetTokenizer", "HealthCheck",
        }
    )  # fmt: skip
    # Per-instance cache, set on first use (an immutable default).
    _metrics_for: LoadSnapshot | None = None
    _metrics: pb.WorkerMetrics

    def _generation(self, request: pb.GenerateRequest, context: Context) -> GenerationRequest:
        trace = trace_headers(context.invocation_metadata())
        return convert.to_generation_request(request, self._engine.facts, trace)

    @handles_errors
    async def GenerateStream(
        self, request: pb.GenerateRequest, context: Context
    ) -> AsyncIterator[pb.GenerateStreamResponse]:
        generation = self._generation(request, context)
        request_id = generation.request_id
        first = True

        def render(step: EngineStep) -> tuple[pb.GenerateStreamResponse]:
            nonlocal first
            message = self._stream_message(request_id, step, first)
            first = False
            return (message,)

        direct_send = self._direct_send(context, responses.direct_step_renderer(request_id))
        async with self._requests.run(generation, direct_send=direct_send) as flight:
            async for message in flight.messages(render):
                yield message

    @handles_errors
    async def GenerateBatch(
        self, requests: AsyncIterator[pb.GenerateBatchRequest | Malformed], context: Context
    ) -> AsyncIterator[pb.GenerateBatchResponse]:
        session: Session = BatchSession(
            self._requests,
            self._state,
            self._stream_message,
            responses.request_error,
            self._count_batched,
        )
        trace = trace_headers(context.invocation_metadata())
        reading = asyncio.create_task(self._read_batch(requests, session, trace))
        async for message in session.sends(reading):
            yield responses.batch_message(message)

    async def _read_batch(
        self,
        requests: AsyncIterator[pb.GenerateBatchRequest | Malformed],
        session: Session,
        trace: Mapping[str, str] | None,
    ) -> None:
        try:
            async for item in requests:
                if isinstance(item, Malformed):
                    message = item.invalid().message
                    session.fail("", grpc.StatusCode.INVALID_ARGUMENT, message, refused=True)
                    continue
                action = item.WhichOneof("action")
                if action == "abort":
                    await session.abort(list(item.abort.request_ids))
                elif action == "generate":
                    request_id = item.generate.request_id
                    try:
                        if not request_id:
                            raise InvalidRequest(
                                "generate.request_id is empty: on GenerateBatch every request "
                                "needs an id (its answers carry it)"
                            )
                        generation = convert.to_generation_request(
                            item.generate,
                            self._engine.facts,
                            request_trace(item.traceparent, trace, "traceparent"),
                        )
                    except Exception as exc:  # one request's conversion, not the stream's
                        code, message = await failure_status(self._state, exc)
                        session.fail(request_id, code, message, refused=True)
                        continue
                    session.start(
                        request_id,
                        generation,
                        item.timeout_ms / 1000,
                        compact=item.compact_tokens,
                    )
                else:
                    message = "a GenerateBatchRequest must set generate or abort"
                    session.fail("", grpc.StatusCode.INVALID_ARGUMENT, message, refused=True)
        finally:
            session.outbox.poke()  # the sender checks whether the stream is done

    def _count_batched(self, code: grpc.StatusCode) -> None:
        # Each request on a GenerateBatch stream is counted as an RPC of its own would be.
        if self.core.metrics is not None:
            labels = (SERVICE_NAME, "GenerateBatch:request", code.name)
            self.core.metrics.requests.labels(*labels).inc()

    def _stream_message(
        self, request_id: str, step: EngineStep, first: bool
    ) -> pb.GenerateStreamResponse:
        """One step as GenerateStream sends it, on either stream RPC."""
        responses.raise_if_failed(step)
        # Worker load rides on the first and the last message.
        metrics = self._worker_metrics() if first or step.finished else None
        return responses.stream_message(request_id, step, metrics)

    @handles_errors
    async def Generate(self, request: pb.GenerateRequest, context: Context) -> pb.GenerateResponse:
        generation = self._generation(request, context)
        result = RequestResult()
        async with self._requests.run(generation) as flight:
            async for step in flight.steps():
                responses.raise_if_failed(step)
                result.add(step)
            flight.answering()
        return responses.unary_response(generation.request_id, result, self._worker_metrics())

    @handles_errors
    async def Embed(self, request: pb.EmbedRequest, context: Context) -> pb.EmbedResponse:
        request_id = checked_request_id(request.request_id)
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
        try:
            digest = await self.core.tokenizer.derive(tokenizer_digest)
        except Unsupported:  # an engine without tokenizer files (the mock)
            digest = ""
        return responses.model_info(facts, adapters, digest)

    @handles_errors
    async def GetLoads(self, request: pb.GetLoadsRequest, context: Context) -> pb.GetLoadsResponse:
        await self._state.require_engine()
        return responses.loads(self._engine.loads(), len(self._requests.in_flight))

    @handles_errors
    async def GetTokenizer(
        self, request: pb.GetTokenizerRequest, context: Context
    ) -> AsyncIterator[pb.GetTokenizerResponse]:
        await self._state.require_engine()
        files = await self.core.tokenizer.files()
        for chunk in responses.tokenizer_chunks(
            files, await self.core.tokenizer.derive(tokenizer_digest)
        ):
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
        path = request.path
        if self._engine.facts.supports_lora:  # else the engine says it has no LoRA first
            path = self.core.lora_paths.check(path)
        await self._engine.load_lora_adapter(request.name, path)
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
