"""NativeInferenceServicer and NativeControlServicer: vLLM's native contract
(`vllm.Inference`, `vllm.Control`: what vllm-rs serves and vllm-router speaks), over the
serving core every contract shares.

Handlers are thin: convert.py in, the core's request table, responses.py out; errors are
mapped by `core.handles_errors` as for every contract.
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TypeAlias

import grpc

from ...core import ContractServicer, handles_errors
from ...core.accumulate import RequestResult
from ...core.request_fields import trace_headers
from ...core.weight_updates import Step
from ...engine import NO_DRAFT_MODEL, NO_WEIGHT_TRANSFER, EngineStep, GenerationRequest, LoraAdapter
from ...errors import InvalidRequest, NotConfigured, NotFound
from ...proto import vllm_native_pb2 as npb
from ...proto import vllm_native_pb2_grpc as npb_grpc
from . import control, convert, responses
from .responses import Wanted

INFERENCE_SERVICE = npb.DESCRIPTOR.services_by_name["Inference"].full_name
CONTROL_SERVICE = npb.DESCRIPTOR.services_by_name["Control"].full_name
Context: TypeAlias = grpc.aio.ServicerContext
Metadata: TypeAlias = Sequence[tuple[str, str | bytes]] | None


class NativeInferenceServicer(ContractServicer, npb_grpc.InferenceServicer):
    service_label = INFERENCE_SERVICE
    router_rpcs = frozenset({"GenerateStream", "Generate"})

    async def _generation(
        self, request: npb.GenerateRequest, metadata: Metadata, *, unary: bool = False
    ) -> GenerationRequest:
        facts = self._engine.facts
        loaded: list[str] = []
        if request.lora_name and facts.supports_lora:
            loaded = [adapter.name for adapter in await self._engine.list_lora_adapters()]
        generation = convert.to_generation_request(
            request, facts, metadata, trace_headers(metadata), unary=unary, loaded=loaded
        )
        if convert.needs_prompt_ids(generation, request):
            # The echo and the truncation need a text prompt's ids before it runs.
            tokenized = await self._requests.admission.tokenized(generation)
            generation = convert.with_prompt_ids(tokenized, request, facts)
        return generation

    @handles_errors
    async def GenerateStream(
        self, request: npb.GenerateRequest, context: Context
    ) -> AsyncIterator[npb.GenerateResponse]:
        metadata = context.invocation_metadata()
        with convert.sequences_first(request, metadata, self._engine.facts):
            generation = await self._generation(request, metadata)
            wanted = Wanted.of(request.response)
            # prompt_info goes with the engine's first step, as vllm-rs sends it, not before:
            # a stream that has said nothing when its worker fails is one a router retries
            # on another worker (test_e2e_router_faults.py's hung worker).
            render = self._stream_renderer(wanted, generation.prompt_token_ids)
            direct_send = self._direct_send(context, responses.direct_step_renderer(wanted))
            async with self._requests.run(generation, direct_send=direct_send) as flight:
                async for message in flight.messages(render):
                    yield message

    def _stream_renderer(
        self, wanted: Wanted, prompt_ids: list[int] | None
    ) -> Callable[[EngineStep], list[npb.GenerateResponse]]:
        """As vllm-rs: the prompt's facts in a message of their own first, then one message
        per sequence per engine step."""
        first = True
        eos = self._eos

        def render(step: EngineStep) -> list[npb.GenerateResponse]:
            nonlocal first
            output = responses.sequence_output(step, wanted, eos)
            if not first:
                return [output]
            first = False
            return [responses.prompt_info(step, prompt_ids, wanted), output]

        return render

    @handles_errors
    async def Generate(
        self, request: npb.GenerateRequest, context: Context
    ) -> npb.GenerateResponse:
        metadata = context.invocation_metadata()
        with convert.sequences_first(request, metadata, self._engine.facts):
            generation = await self._generation(request, metadata, unary=True)
            result = RequestResult()
            async with self._requests.run(generation) as flight:
                async for step in flight.steps():
                    result.add(step)
                flight.answering()  # the whole answer, below
        wanted = Wanted.of(request.response)
        return responses.whole_answer(result, generation.prompt_token_ids, wanted, self._eos)


class NativeControlServicer(ContractServicer, npb_grpc.ControlServicer):
    service_label = CONTROL_SERVICE
    # vllm.Control mixes what a router asks (info, Abort, KV event sources) with what changes
    # the worker; vLLM splits the two by caller (`--grpc-services`), this worker by key.
    control_rpcs = frozenset(
        {
            "LoadLora", "UnloadLora", "ListLoras", "Shutdown", "PauseGeneration",
            "ResumeGeneration", "IsPaused", "Sleep", "WakeUp", "IsSleeping",
            "InitWeightTransferEngine", "StartWeightUpdate", "StartDraftWeightUpdate",
            "UpdateWeights", "FinishWeightUpdate", "UpdateWeightVersion", "GetWeightVersion",
        }
    )  # fmt: skip
    router_rpcs = frozenset({"GetServerInfo", "GetModelInfo", "Abort", "GetKvEventSources"})

    @functools.cached_property
    def _instance_id(self) -> str:
        # Stable for this worker's life: a router keys its KV-event state by it.
        return self._engine.facts.instance_id or uuid.uuid4().hex

    def _require_lora(self) -> None:
        if not self._engine.facts.supports_lora:
            raise NotConfigured(convert.NO_LORA)

    async def _operation(
        self,
        name: str,
        context: Context,
        work: Callable[[], Awaitable[object]],
        step: Step | None = None,
        **attributes: str | int | bool,
    ) -> None:
        """Run one RL operation holding the engine (core.operations: one at a time, in
        arrival order, as vllm-rs serializes them, to the end of the engine's call even
        when the caller leaves; measured and traced), as `step` of the weight-update
        sequence when it is one (core.weight_updates). Checks run before it."""
        trace = trace_headers(context.invocation_metadata())
        if step is not None:
            work = functools.partial(self._weight_step, step, work)
        await self.core.operations.run(name, trace, attributes, work)

    async def _weight_step(self, step: Step, work: Callable[[], Awaitable[object]]) -> None:
        async with self.core.weight_updates.step(step):
            await work()

    def _require_weight_transfer(self) -> None:
        if not self._engine.facts.weight_transfer_backend:
            raise NotConfigured(NO_WEIGHT_TRANSFER)

    @handles_errors
    async def GetServerInfo(
        self, request: npb.GetServerInfoRequest, context: Context
    ) -> npb.GetServerInfoResponse:
        await self._state.require_engine()
        return responses.server_info(self._engine.facts, self._instance_id)

    @handles_errors
    async def GetModelInfo(
        self, request: npb.GetModelInfoRequest, context: Context
    ) -> npb.GetModelInfoResponse:
        await self._state.require_engine()
        return responses.model_info(self._engine.facts)

    @handles_errors
    async def Abort(self, request: npb.AbortRequest, context: Context) -> npb.AbortResponse:
        await self._requests.abort(list(request.request_ids))
        return npb.AbortResponse()

    @handles_errors
    async def GetKvEventSources(
        self, request: npb.GetKvEventSourcesRequest, context: Context
    ) -> npb.GetKvEventSourcesResponse:
        await self._state.require_engine()
        return responses.kv_event_sources(self._engine.kv_event_sources())

    @handles_errors
    async def LoadLora(
        self, request: npb.LoadLoraRequest, context: Context
    ) -> npb.LoadLoraResponse:
        if not request.lora_name.strip() or not request.source_path:
            raise InvalidRequest("LoadLora needs lora_name and source_path")
        await self._state.require_engine()
        self._require_lora()
        path = self.core.lora_paths.check(request.source_path)
        await self._engine.load_lora_adapter(request.lora_name, path)
        adapter = await self._adapter(request.lora_name)
        return npb.LoadLoraResponse(adapter=responses.lora_adapter(adapter))

    @handles_errors
    async def UnloadLora(
        self, request: npb.UnloadLoraRequest, context: Context
    ) -> npb.UnloadLoraResponse:
        if not request.lora_name.strip():
            raise InvalidRequest("lora_name is required")
        await self._state.require_engine()
        self._require_lora()
        adapter = await self._adapter(request.lora_name)
        await self._engine.unload_lora_adapter(request.lora_name)
        return npb.UnloadLoraResponse(adapter=responses.lora_adapter(adapter))

    async def _adapter(self, name: str) -> LoraAdapter:
        for adapter in await self._engine.list_lora_adapters():
            if adapter.name == name:
                return adapter
        raise NotFound(f"no LoRA adapter named {name!r} on this worker")

    @handles_errors
    async def ListLoras(
        self, request: npb.ListLorasRequest, context: Context
    ) -> npb.ListLorasResponse:
        await self._state.require_engine()
        self._require_lora()
        adapters = await self._engine.list_lora_adapters()
        adapters.sort(key=lambda a: a.name)
        return npb.ListLorasResponse(adapters=[responses.lora_adapter(a) for a in adapters])

    @handles_errors
    async def Shutdown(
        self, request: npb.ShutdownRequest, context: Context
    ) -> npb.ShutdownResponse:
        raise NotConfigured(
            "this worker's process is managed by its supervisor, not over gRPC: send it "
            "SIGTERM to drain and stop it"
        )

    @handles_errors
    async def PauseGeneration(
        self, request: npb.PauseGenerationRequest, context: Context
    ) -> npb.PauseGenerationResponse:
        mode, clear_cache = control.pause(request)
        await self._state.require_engine()
        pause = functools.partial(self._engine.pause, mode, clear_cache)
        await self._operation("pause", context, pause, mode=mode, clear_cache=clear_cache)
        return npb.PauseGenerationResponse()

    @handles_errors
    async def ResumeGeneration(
        self, request: npb.ResumeGenerationRequest, context: Context
    ) -> npb.ResumeGenerationResponse:
        await self._state.require_engine()
        await self._operation("resume", context, self._engine.resume)
        return npb.ResumeGenerationResponse()

    @handles_errors
    async def IsPaused(
        self, request: npb.IsPausedRequest, context: Context
    ) -> npb.IsPausedResponse:
        await self._state.require_engine()
        return npb.IsPausedResponse(paused=await self._engine.is_paused())

    @handles_errors
    async def Sleep(self, request: npb.SleepRequest, context: Context) -> npb.SleepResponse:
        await self._state.require_engine()
        level, mode, reset_connector = control.sleep(request, self._engine.facts)
        sleep = functools.partial(self._engine.sleep, level, mode, reset_connector=reset_connector)
        await self._operation("sleep", context, sleep, level=level, mode=mode)
        return npb.SleepResponse()

    @handles_errors
    async def WakeUp(self, request: npb.WakeUpRequest, context: Context) -> npb.WakeUpResponse:
        await self._state.require_engine()
        wake_up = functools.partial(self._engine.wake_up, list(request.tags) or None)
        await self._operation("wake_up", context, wake_up)
        return npb.WakeUpResponse()

    @handles_errors
    async def IsSleeping(
        self, request: npb.IsSleepingRequest, context: Context
    ) -> npb.IsSleepingResponse:
        await self._state.require_engine()
        return npb.IsSleepingResponse(sleeping=await self._engine.is_sleeping())

    @handles_errors
    async def InitWeightTransferEngine(
        self, request: npb.InitWeightTransferEngineRequest, context: Context
    ) -> npb.InitWeightTransferEngineResponse:
        self._require_weight_transfer()
        init_info = control.json_object(request.init_info_json, "init_info_json")
        await self._state.require_engine()
        init = functools.partial(self._engine.init_weight_transfer, init_info)
        await self._operation("init_weight_transfer", context, init, Step.INIT)
        return npb.InitWeightTransferEngineResponse()

    @handles_errors
    async def StartWeightUpdate(
        self, request: npb.StartWeightUpdateRequest, context: Context
    ) -> npb.StartWeightUpdateResponse:
        self._require_weight_transfer()
        await self._state.require_engine()
        start = functools.partial(self._engine.start_weight_update, draft=False)
        await self._operation("start_weight_update", context, start, Step.START, draft=False)
        return npb.StartWeightUpdateResponse()

    @handles_errors
    async def StartDraftWeightUpdate(
        self, request: npb.StartDraftWeightUpdateRequest, context: Context
    ) -> npb.StartDraftWeightUpdateResponse:
        self._require_weight_transfer()
        if not self._engine.facts.draft_weight_updates:
            raise NotConfigured(NO_DRAFT_MODEL)
        await self._state.require_engine()
        start = functools.partial(self._engine.start_weight_update, draft=True)
        await self._operation("start_weight_update", context, start, Step.START, draft=True)
        return npb.StartDraftWeightUpdateResponse()

    @handles_errors
    async def UpdateWeights(
        self, request: npb.UpdateWeightsRequest, context: Context
    ) -> npb.UpdateWeightsResponse:
        self._require_weight_transfer()
        update_info = control.json_object(request.update_info_json, "update_info_json")
        await self._state.require_engine()
        update = functools.partial(self._engine.update_weights, update_info)
        await self._operation("update_weights", context, update, Step.UPDATE)
        return npb.UpdateWeightsResponse()

    @handles_errors
    async def FinishWeightUpdate(
        self, request: npb.FinishWeightUpdateRequest, context: Context
    ) -> npb.FinishWeightUpdateResponse:
        self._require_weight_transfer()
        version = None
        if request.HasField("weight_version"):
            version = control.weight_version(request.weight_version)
        await self._state.require_engine()
        finish = functools.partial(self._engine.finish_weight_update, version)
        await self._operation(
            "finish_weight_update", context, finish, Step.FINISH, weight_version=version or ""
        )
        return npb.FinishWeightUpdateResponse()

    @handles_errors
    async def UpdateWeightVersion(
        self, request: npb.UpdateWeightVersionRequest, context: Context
    ) -> npb.UpdateWeightVersionResponse:
        version = control.weight_version(request.weight_version)
        await self._state.require_engine()
        set_version = functools.partial(self._engine.set_weight_version, version)
        await self._operation("update_weight_version", context, set_version, weight_version=version)
        return npb.UpdateWeightVersionResponse()

    @handles_errors
    async def GetWeightVersion(
        self, request: npb.GetWeightVersionRequest, context: Context
    ) -> npb.GetWeightVersionResponse:
        await self._state.require_engine()
        return npb.GetWeightVersionResponse(weight_version=await self._engine.weight_version())
