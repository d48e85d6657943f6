"""Adapter from vLLM's v1 AsyncLLM to the engine protocol.

vLLM is imported lazily: importing this module is cheap and works without vLLM.
Conversions live in params.py, load figures in stats.py, LoRA names in lora.py; every
vLLM internal the adapter touches is named and checked in compat.py.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar, cast

from prometheus_client.registry import Collector

from ...errors import (
    EngineDead,
    NotConfigured,
    Unsupported,
)
from ..direct import DirectReceiver, takes_direct_steps
from ..protocol import PauseMode
from ..types import (
    Embedding,
    EngineProgress,
    EngineStep,
    GenerationRequest,
    KvEventBatch,
    KvEventSource,
    LoadSnapshot,
    LoraAdapter,
    ModelFacts,
    RankLoad,
    one_plain_sample,
)
from .compat import (
    BULK_LATENCIES,
    DIRECT_ENTRY,
    ENGINE_EXIT,
    ENGINE_PROGRESS,
    ENGINE_SERIES,
    FAST_OUTPUTS,
    KV_EVENT_ENDPOINT,
    LEAN_OUTPUTS,
    LOAD_FIGURES,
    MEDIA,
    RENDER,
    TOKENIZE,
    WEIGHT_RELOAD_ABORT,
    WEIGHT_TRANSFER,
    check_touch_points,
)
from .entry import DirectEntry, VllmCall
from .facts import model_facts, read_tokenizer_files
from .fast_outputs import FastOutputs
from .generate import lean_steps, request_output_steps
from .holds import Holds
from .introspect import parameters
from .kv_events import kv_event_batches, kv_event_sources
from .lora import LoraRegistry
from .media_inputs import media_input, processed_input
from .params import SharedParams, build_sampling_params, reraise
from .stats import BulkLatencies, LoadBoard, capture_engine_registry
from .weight_transfer import WeightTransfer

if TYPE_CHECKING:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.inputs import TextPrompt, TokensPrompt
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.async_llm import AsyncLLM

logger = logging.getLogger(__name__)
T = TypeVar("T")


class VllmEngine:
    """The engine protocol over a running vLLM AsyncLLM."""

    def __init__(
        self,
        llm: AsyncLLM,
        board: LoadBoard,
        *,
        lean_outputs: bool = True,
        direct_entry: bool = True,
    ) -> None:
        self._llm = llm
        # The features whose vLLM internals match this vLLM (compat.py logs the rest).
        self.features = check_touch_points(llm)
        # Token streams without a RequestOutput per step where a request allows it
        # (lean.py); off when asked, or when this vLLM lacks the points it takes over.
        self.lean_outputs = lean_outputs and LEAN_OUTPUTS in self.features
        # Token-only requests' decode steps without vLLM's per-request output work: the
        # output-loop path direct steps take (engine/direct.py), at the engine's own stream
        # interval (--stream-interval; vLLM streams a request at the larger of the two).
        self.fast_outputs: FastOutputs | None = None
        self._stream_interval: int = getattr(llm.vllm_config.scheduler_config, "stream_interval", 1)
        if self.lean_outputs and FAST_OUTPUTS in self.features:
            from vllm import envs
            from vllm.v1.metrics.loggers import PrometheusStatLogger

            manager = llm.logger_manager
            bulk = BULK_LATENCIES in self.features and manager is not None
            if manager is not None and bulk:
                loggers = manager.stat_loggers
                (prometheus,) = (x for x in loggers if isinstance(x, PrometheusStatLogger))
                BulkLatencies(prometheus)
            self.fast_outputs = FastOutputs(
                llm.output_processor,
                count_nans=bool(envs.VLLM_COMPUTE_NANS_IN_LOGITS),
                bulk_latencies=bulk,
            )
        # Token-id requests into the engine core without add_request's general work.
        self.direct_entry = (
            DirectEntry(llm)
            if direct_entry and self.lean_outputs and DIRECT_ENTRY in self.features
            else None
        )
        self._board = board
        # Paused or asleep by our own call: its requests are held on purpose, not stuck.
        self._holds = Holds(llm, board.stepped)
        self._progress = ENGINE_PROGRESS in self.features
        if LOAD_FIGURES not in self.features:
            board.unmeasured()  # figures this vLLM does not give are unknown, never 0
        self._prometheus = capture_engine_registry(ENGINE_SERIES in self.features)
        model_config = llm.vllm_config.model_config
        self._max_model_len = model_config.max_model_len
        self._model_defaults = model_config.get_diff_sampling_param()
        self._params = SharedParams(
            functools.partial(
                build_sampling_params,
                model_defaults=self._model_defaults,
                max_model_len=self._max_model_len,
            )
        )
        self._facts = model_facts(llm, self._model_defaults, media=MEDIA in self.features)
        self._loras = LoraRegistry(llm, self._facts.supports_lora)
        self._weights = WeightTransfer(
            llm,
            self._facts,
            self._call,
            supported=WEIGHT_TRANSFER in self.features,
            restartable=WEIGHT_RELOAD_ABORT in self.features,
        )
        if self._model_defaults:
            logger.info(
                "Model generation-config defaults for unset fields: %s", self._model_defaults
            )

    @classmethod
    def from_engine_args(
        cls, engine_args: AsyncEngineArgs, *, lean_outputs: bool = True, direct_entry: bool = True
    ) -> VllmEngine:
        """Start an AsyncLLM (spawns the engine-core process) wired to our load board."""
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM

        if engine_args.disable_log_stats:
            logger.warning(
                "--disable-log-stats also stops the scheduler statistics behind "
                "WorkerMetrics and GetLoads; keeping stats on"
            )
        vllm_config = engine_args.create_engine_config(UsageContext.OPENAI_API_SERVER)
        board = LoadBoard(vllm_config.parallel_config.data_parallel_size)
        llm = AsyncLLM.from_vllm_config(
            vllm_config,
            usage_context=UsageContext.OPENAI_API_SERVER,
            stat_loggers=[board.stat_logger_factory()],
            enable_log_requests=engine_args.enable_log_requests,
            disable_log_stats=False,
        )
        return cls(llm, board, lean_outputs=lean_outputs, direct_entry=direct_entry)

    @property
    def facts(self) -> ModelFacts:
        return self._facts

    @property
    def errored(self) -> bool:
        return self._llm.errored

    @property
    def llm(self) -> AsyncLLM:
        return self._llm

    def load(self) -> LoadSnapshot:
        return self._board.snapshot

    def loads(self) -> list[RankLoad]:
        return self._board.ranks()

    def progress(self) -> EngineProgress:
        if not self._progress:
            return EngineProgress(busy=False, last_step=None)
        held = self._holds.held
        busy = not held and bool(self._llm.output_processor.request_states)
        return EngineProgress(busy=busy, last_step=self._board.last_step, held=held)

    def _work_arrives(self) -> None:
        """A request is about to enter the engine: an idle engine's silence so far is no
        stall, so the watchdog's clock starts now."""
        if self._progress and not self._llm.output_processor.request_states:
            self._board.stepped()

    async def check_health(self) -> None:
        try:
            await self._llm.check_health()
        except Exception as exc:
            raise EngineDead(f"vLLM engine health check failed: {exc}") from exc

    async def reset_prefix_cache(self) -> bool:
        if self._llm.errored:
            raise EngineDead("vLLM engine is dead; cannot reset its prefix cache")
        try:
            return await self._llm.reset_prefix_cache()
        except Exception as exc:
            reraise(exc)

    async def abort(self, request_id: str) -> None:
        if not self._llm.errored:
            await self._llm.abort(request_id)

    def prometheus_registry(self) -> Collector | None:
        # The series vLLM's OpenAI server exposes: vllm:*, process and Python.
        return self._prometheus

    async def shutdown(self) -> None:
        # Lets engine-core processes finish their own teardown (shutdown.py).
        from .shutdown import shutdown_engine

        await shutdown_engine(self._llm, wait_for_exits=ENGINE_EXIT in self.features)

    async def list_lora_adapters(self) -> list[LoraAdapter]:
        return self._loras.adapters()

    async def load_lora_adapter(self, name: str, path: str) -> None:
        await self._loras.load(name, path)

    async def unload_lora_adapter(self, name: str) -> None:
        await self._loras.unload(name)

    async def tokenizer_files(self) -> list[tuple[str, bytes]]:
        return await asyncio.to_thread(read_tokenizer_files, self._llm.model_config.tokenizer)

    def kv_events(self) -> AsyncGenerator[KvEventBatch, None]:
        config = self._llm.vllm_config.kv_events_config
        return kv_event_batches(
            config,
            getattr(config, "topic", "") or "",
            dp_size=self._facts.dp_size,
            vllm_bind_rule=KV_EVENT_ENDPOINT in self.features,
        )

    def kv_event_sources(self) -> list[KvEventSource]:
        return kv_event_sources(
            self._llm.vllm_config.kv_events_config,
            self._facts.dp_size,
            vllm_bind_rule=KV_EVENT_ENDPOINT in self.features,
        )

    async def pause(self, mode: PauseMode, clear_cache: bool) -> None:
        await self._holds.pause(mode, clear_cache)

    async def resume(self) -> None:
        await self._holds.resume()

    async def is_paused(self) -> bool:
        return bool(await self._call(self._llm.is_paused))

    async def sleep(self, level: int, mode: PauseMode, *, reset_connector: bool = True) -> None:
        self._require_sleep_mode()
        # vLLM 0.34's sleep takes reset_connector; earlier ones always clear the connector's
        # cache at level 1 or 2, which only matters with a KV connector configured.
        if "reset_connector" in parameters(self._llm.sleep):
            await self._holds.sleep(level, mode, reset_connector=reset_connector)
            return
        if not reset_connector and level >= 1 and self._llm.vllm_config.kv_transfer_config:
            raise Unsupported(
                "this vLLM clears the KV connector's cache whenever it sleeps at level 1 or 2; "
                "reset_connector=false needs a vLLM whose sleep takes it (0.34 or later)"
            )
        await self._holds.sleep(level, mode)

    async def wake_up(self, tags: list[str] | None) -> None:
        self._require_sleep_mode()
        await self._holds.wake_up(tags)

    async def is_sleeping(self) -> bool:
        return bool(await self._call(self._llm.is_sleeping))

    async def weight_version(self) -> str:
        return str(await self._call(self._llm.get_weight_version))

    async def set_weight_version(self, version: str) -> None:
        await self._call(self._llm.update_weight_version, version)

    async def init_weight_transfer(self, init_info: dict[str, Any]) -> None:
        await self._weights.init(init_info)

    async def start_weight_update(self, *, draft: bool) -> None:
        await self._weights.start(draft=draft)

    async def update_weights(self, update_info: dict[str, Any]) -> None:
        await self._weights.update(update_info)

    async def finish_weight_update(self, version: str | None) -> None:
        await self._weights.finish(version)

    def _require_sleep_mode(self) -> None:
        if not self._llm.vllm_config.model_config.enable_sleep_mode:
            raise NotConfigured(
                "sleep mode is not enabled on this engine (start it with --enable-sleep-mode, "
                "on a platform that supports it)"
            )

    async def _call(self, operation: Callable[..., Awaitable[T]], *args: Any, **kwargs: Any) -> T:
        """An AsyncLLM operation on a live engine, its failures told as the servicer's errors."""
        if self._llm.errored:
            raise EngineDead("vLLM engine is dead; retry on another worker")
        try:
            return await operation(*args, **kwargs)
        except Exception as exc:
            reraise(exc)

    async def start_profile(self) -> None:
        self._require_profiler()
        try:
            await self._llm.start_profile()
        except Exception as exc:
            reraise(exc)

    async def stop_profile(self) -> None:
        self._require_profiler()
        try:
            await self._llm.stop_profile()
        except Exception as exc:
            reraise(exc)

    def _require_profiler(self) -> None:
        if self._llm.vllm_config.profiler_config.profiler is None:
            raise NotConfigured(
                "no profiler is configured on this worker (start it with --profiler-config)"
            )

    async def tokenize(self, text: str) -> list[int]:
        """Tokenized as vLLM's completions server does (special tokens added)."""
        try:
            if TOKENIZE not in self.features:
                tokenizer = self._llm.get_tokenizer()
                return list(await asyncio.to_thread(tokenizer.encode, text))
            renderer = self._llm.renderer
            prompt = await renderer.tokenize_prompt_async(
                cast("TextPrompt", {"prompt": text}), renderer.default_cmpl_tok_params
            )
        except Exception as exc:
            reraise(exc)
        return list(prompt["prompt_token_ids"])  # type: ignore[typeddict-item]

    def _engine_prompt(self, ids: list[int], cache_salt: str | None = None) -> Any:
        """The prompt as vLLM's own completions server hands it over: rendered here, so a
        prompt that is already token ids takes no tokenizer work and no thread-pool hop."""
        prompt = cast("TokensPrompt", {"prompt_token_ids": ids})
        if cache_salt:
            prompt["cache_salt"] = cache_salt
        if RENDER not in self.features:
            return prompt
        return self._llm.renderer.process_for_engine(prompt, arrival_time=time.time())

    async def embed(self, request_id: str, prompt_token_ids: list[int]) -> Embedding:
        from vllm.pooling_params import PoolingParams

        prompt = self._engine_prompt(prompt_token_ids)
        self._work_arrives()
        outputs = self._llm.encode(prompt, PoolingParams(task="embed"), request_id)
        try:
            async for out in outputs:
                if out.finished:
                    values = out.outputs.data.tolist()
                    return Embedding(values, len(out.prompt_token_ids or prompt_token_ids))
        except Exception as exc:
            reraise(exc)
        finally:
            await outputs.aclose()
        raise RuntimeError("the engine ended the embedding request without a result")

    def _sampling_params(self, request: GenerationRequest, prompt_len: int) -> SamplingParams:
        try:
            return self._params.get(
                request.sampling,
                prompt_len,
                detokenize=request.detokenize,
                kv_transfer_params=request.kv_transfer_params,
                skip_prefix_cache=request.skip_prefix_cache,
            )
        except Exception as exc:
            reraise(exc)

    def check_sampling(self, request: GenerationRequest) -> None:
        self._sampling_params(request, len(request.prompt_token_ids or ()))

    def generate(
        self, request: GenerationRequest, *, receiver: DirectReceiver | None = None
    ) -> AsyncGenerator[EngineStep, None]:
        # A plain method returning the steps' generator: no extra generator layer per
        # token; invalid parameters raise here, before the request reaches vLLM.
        ids = request.prompt_token_ids
        if ids is None:
            raise ValueError("VllmEngine.generate needs prompt_token_ids (tokenize text first)")
        if request.media or request.processed_media:
            return self._media_steps(request, ids)
        return self._steps(request, ids, self._engine_prompt(ids, request.cache_salt), receiver)

    def _steps(
        self,
        request: GenerationRequest,
        ids: list[int],
        prompt: Any,
        receiver: DirectReceiver | None = None,
    ) -> AsyncGenerator[EngineStep, None]:
        options = request.sampling
        params = self._sampling_params(request, len(ids))
        call = VllmCall(
            request_id=request.request_id,
            prompt=prompt,
            prompt_token_ids=ids,
            params=params,
            options={
                "lora_request": self._loras.request_for(request.lora_name),
                "trace_headers": request.trace_headers,
                "priority": request.priority,
                "data_parallel_rank": request.dp_rank,
                # Only when set: a vLLM without sessions still serves everything else.
                **({"session_id": request.session_id} if request.session_id else {}),
                **_reasoning_gate(request),
            },
            detokenize=request.detokenize,
        )
        self._work_arrives()
        if self.lean_outputs and one_plain_sample(options, params.n):
            fast, entry = self.fast_outputs, self.direct_entry
            # Direct only from fast outputs' loop, and only what the rule allows.
            direct = fast is not None and takes_direct_steps(
                options,
                params.n,
                detokenize=request.detokenize,
                engine_interval=self._stream_interval,
            )
            return lean_steps(
                self._llm,
                call,
                fast,
                receiver if direct else None,
                entry if entry is not None and entry.admits(call) else None,
            )
        return request_output_steps(self._llm, call, options)

    async def _media_steps(
        self, request: GenerationRequest, ids: list[int]
    ) -> AsyncGenerator[EngineStep, None]:
        """A prompt with media: processed off the event loop first; its expanded ids then
        size the request (the default max_tokens, the usage counts) as any prompt's."""
        if request.processed_media:
            engine_input = await processed_input(self._llm, ids, request)
        else:
            engine_input = await media_input(self._llm, ids, request)
        expanded = list(engine_input["prompt_token_ids"])
        steps = self._steps(request, expanded, engine_input)
        try:
            async for step in steps:
                yield step
        finally:
            await steps.aclose()


def _reasoning_gate(request: GenerationRequest) -> dict[str, Any]:
    """The reasoning gate's keywords for AsyncLLM, only when the request sets it."""
    gate: dict[str, Any] = {}
    if request.reasoning_ended is not None:
        gate["reasoning_ended"] = request.reasoning_ended
    if request.reasoning_kwargs is not None:
        gate["reasoning_parser_kwargs"] = dict(request.reasoning_kwargs)
    return gate
