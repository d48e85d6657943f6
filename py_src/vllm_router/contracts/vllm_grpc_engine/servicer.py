"""VllmGrpcServicer: vllm.grpc.engine.VllmEngine (what `vllm serve --grpc` serves, the
contract the SMG router speaks), over the serving core every contract shares.

Handlers are thin: convert.py in, the core's request table, responses.py out; errors
are mapped by `core.handles_errors` as for every contract.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Callable
from typing import TypeAlias

import grpc
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc

from ...core import ContractServicer, handles_errors
from ...core.accumulate import RequestResult
from ...core.request_fields import checked_request_id, trace_headers
from ...engine import EngineStep, TokenLogprob
from ...errors import NotConfigured, Unsupported
from . import convert, responses

SERVICE_NAME = vpb.DESCRIPTOR.services_by_name["VllmEngine"].full_name
Context: TypeAlias = grpc.aio.ServicerContext


class VllmGrpcServicer(ContractServicer, vpb_grpc.VllmEngineServicer):
    service_label = SERVICE_NAME
    control_rpcs = frozenset({"FlushCache", "StartProfile", "StopProfile"})
    router_rpcs = frozenset(
        {
            "Generate", "Embed", "HealthCheck", "Abort", "GetModelInfo", "GetServerInfo",
            "GetLoads", "GetTokenizer", "SubscribeKvEvents",
        }
    )  # fmt: skip

    @handles_errors
    async def Generate(
        self, request: vpb.GenerateRequest, context: Context
    ) -> AsyncIterator[vpb.GenerateResponse]:
        trace = trace_headers(context.invocation_metadata())
        generation = convert.to_generation_request(request, self._engine.facts, trace)
        sampling = generation.sampling
        tops = (max(sampling.logprobs or 0, 0), max(sampling.prompt_logprobs or 0, 0))
        # A unary answer is sent whole at the end: only a stream sends steps as they come.
        direct_send = (
            self._direct_send(context, responses.direct_step_renderer()) if request.stream else None
        )
        async with self._requests.run(generation, direct_send=direct_send) as flight:
            if request.stream:
                render = self._stream_renderer(*tops)
                async for message in flight.messages(render):
                    yield message
                return
            result = RequestResult()
            async for step in flight.steps():
                result.add(step)
            flight.answering()  # the whole answer, below
        num_top, num_prompt_top = tops
        for _, sample in result.in_order():
            assert sample.last is not None
            yield responses.complete(
                sample.last, sample.token_ids, sample.logprobs, num_top,
                result.prompt_logprobs, num_prompt_top, self._eos,
            )  # fmt: skip

    def _stream_renderer(
        self, num_top: int, num_prompt_top: int
    ) -> Callable[[EngineStep], list[vpb.GenerateResponse]]:
        """A chunk per step (prompt logprobs on each sample's first), and after a sample's
        finished chunk its complete: as vLLM's --grpc server, the last step's tokens again,
        from which the router takes the finish reason, matched stop and logprobs."""
        prompt: list[TokenLogprob] | None = None
        seen: set[int] = set()

        def render(step: EngineStep) -> list[vpb.GenerateResponse]:
            nonlocal prompt
            if step.prompt_logprobs is not None:
                prompt = step.prompt_logprobs
            first = step.index not in seen
            seen.add(step.index)
            chunk = responses.chunk(step, num_top, prompt if first else None, num_prompt_top)
            if not step.finished:
                return [chunk]
            return [chunk, responses.complete(
                step, step.token_ids, step.logprobs, num_top, prompt, num_prompt_top, self._eos
            )]  # fmt: skip

        return render

    @handles_errors
    async def Embed(self, request: vpb.EmbedRequest, context: Context) -> vpb.EmbedResponse:
        request_id = checked_request_id(request.request_id)
        result = await self._requests.embed(request_id, list(request.tokenized.input_ids))
        return vpb.EmbedResponse(
            embedding=result.values,
            prompt_tokens=result.prompt_tokens,
            embedding_dim=len(result.values),
        )

    @handles_errors
    async def HealthCheck(
        self, request: vpb.HealthCheckRequest, context: Context
    ) -> vpb.HealthCheckResponse:
        status = await self._state.status()
        return vpb.HealthCheckResponse(
            healthy=status.serving, message="Health" if status.serving else status.reason
        )

    @handles_errors
    async def Abort(self, request: vpb.AbortRequest, context: Context) -> vpb.AbortResponse:
        await self._requests.abort(list(request.request_ids))
        return vpb.AbortResponse()

    @handles_errors
    async def FlushCache(
        self, request: common_pb2.FlushCacheRequest, context: Context
    ) -> common_pb2.FlushCacheResponse:
        await self._state.require_engine()
        if await self._engine.reset_prefix_cache():
            return common_pb2.FlushCacheResponse(success=True, message="prefix cache flushed")
        return common_pb2.FlushCacheResponse(
            success=False,
            message="the engine refused to flush its prefix cache while requests hold blocks",
        )

    @handles_errors
    async def StartProfile(
        self, request: common_pb2.StartProfileRequest, context: Context
    ) -> common_pb2.ProfileResponse:
        await self._engine.start_profile()
        return common_pb2.ProfileResponse(success=True, message="profiling started")

    @handles_errors
    async def StopProfile(
        self, request: common_pb2.StopProfileRequest, context: Context
    ) -> common_pb2.ProfileResponse:
        await self._engine.stop_profile()
        return common_pb2.ProfileResponse(success=True, message="profiling stopped")

    @handles_errors
    async def GetModelInfo(
        self, request: vpb.GetModelInfoRequest, context: Context
    ) -> vpb.GetModelInfoResponse:
        await self._state.require_engine()
        return responses.model_info(self._engine.facts)

    @handles_errors
    async def GetServerInfo(
        self, request: vpb.GetServerInfoRequest, context: Context
    ) -> vpb.GetServerInfoResponse:
        await self._state.require_engine()
        active = len(self._requests.in_flight)
        return responses.server_info(self._engine.facts, active, self.core.started)

    @handles_errors
    async def GetLoads(
        self, request: vpb.GetLoadsRequest, context: Context
    ) -> vpb.GetLoadsResponse:
        await self._state.require_engine()
        facts = self._engine.facts
        ranks = self._engine.loads()
        if request.HasField("dp_rank"):
            ranks = [r for r in ranks if r.dp_rank == request.dp_rank]
        kv_tokens = facts.total_kv_blocks * facts.block_size  # per rank, as the cache's size
        return responses.loads(ranks, facts.max_num_seqs, facts.engine_version, kv_tokens)

    @handles_errors
    async def GetTokenizer(
        self, request: common_pb2.GetTokenizerRequest, context: Context
    ) -> AsyncIterator[common_pb2.GetTokenizerChunk]:
        await self._state.require_engine()
        archive = await self.core.tokenizer.derive(responses.tokenizer_zip)
        for piece in responses.tokenizer_chunks(archive):
            yield piece

    @handles_errors
    async def SubscribeKvEvents(
        self, request: common_pb2.SubscribeKvEventsRequest, context: Context
    ) -> AsyncIterator[common_pb2.KvEventBatch]:
        await self._state.require_engine()
        batches = self._engine.kv_events()
        event_ids = itertools.count()
        try:
            async for batch in batches:
                yield responses.kv_event_batch(batch, event_ids)
        except NotConfigured as exc:
            # As vLLM's own server: the router disables KV-event routing on UNIMPLEMENTED.
            raise Unsupported(exc.message) from exc
        finally:
            await batches.aclose()
