"""Adapter from vLLM's v1 AsyncLLM to the servicer's engine protocol.

vLLM is imported lazily: importing this module is cheap and works without vLLM,
so the conversion helpers stay unit-testable everywhere.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import AsyncGenerator, Mapping
from typing import TYPE_CHECKING, Any, NoReturn

from .engine import (
    EngineStep,
    GenerationRequest,
    LoadSnapshot,
    ModelFacts,
    SamplingOptions,
    TokenLogprob,
)
from .errors import EngineUnavailable, InvalidRequest, Overloaded

if TYPE_CHECKING:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.async_llm import AsyncLLM

logger = logging.getLogger(__name__)

# vLLM's OpenAI server fills these from the model's generation config, else
# from these neutral values (CompletionRequest._DEFAULT_SAMPLING_PARAMS).
_NEUTRAL_DEFAULTS: Mapping[str, float] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
}


def build_sampling_params(
    options: SamplingOptions,
    *,
    model_defaults: Mapping[str, Any],
    prompt_len: int | None,
    max_model_len: int,
    detokenize: bool,
) -> SamplingParams:
    """SamplingParams as vLLM's OpenAI server would build them for this request.

    `model_defaults` is `ModelConfig.get_diff_sampling_param()`: a field the client
    left unset takes the model's generation-config value, else vLLM's neutral
    default. Raises vLLM's validation error for values it rejects.
    """
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    picked = {
        name: value if (value := getattr(options, name)) is not None
        else model_defaults.get(name, neutral)
        for name, neutral in _NEUTRAL_DEFAULTS.items()
    }  # fmt: skip
    max_tokens = options.max_tokens
    if max_tokens is None:
        default_max = model_defaults.get("max_tokens")
        if prompt_len is not None:
            room = max_model_len - prompt_len
            max_tokens = room if default_max is None else min(room, default_max)
        else:
            max_tokens = default_max  # None: vLLM fills what the context leaves
    stop_token_ids = list(options.stop_token_ids)
    for extra in model_defaults.get("stop_token_ids") or ():
        if extra not in stop_token_ids:
            stop_token_ids.append(extra)
    return SamplingParams.from_optional(
        **picked,
        seed=options.seed,
        stop=list(options.stop),
        stop_token_ids=stop_token_ids,
        ignore_eos=bool(options.ignore_eos),
        max_tokens=max_tokens,
        min_tokens=options.min_tokens or 0,
        logprobs=options.logprobs,
        detokenize=detokenize,
        skip_special_tokens=options.skip_special_tokens is not False,
        include_stop_str_in_output=bool(options.include_stop_str_in_output),
        output_kind=RequestOutputKind.DELTA,
        skip_clone=True,
    )


def convert_logprobs(token_ids: list[int], positions: Any, top_k: int) -> list[TokenLogprob]:
    """vLLM's per-position {token id: Logprob} maps -> TokenLogprob, top-k by rank."""
    entries = []
    for token_id, position in zip(token_ids, positions or (), strict=False):
        sampled = position.get(token_id) if position else None
        top = sorted(
            (lp.rank, tid, lp.logprob)
            for tid, lp in (position or {}).items()
            if lp.rank is not None and lp.rank <= top_k
        )
        entries.append(
            TokenLogprob(
                token_id=token_id,
                logprob=sampled.logprob if sampled is not None else -math.inf,
                top=tuple((tid, logprob) for _, tid, logprob in top),
            )
        )
    return entries


class LoadBoard:
    """Latest scheduler statistics, written by a vLLM stat logger every engine step."""

    def __init__(self) -> None:
        self._per_engine: dict[int, LoadSnapshot] = {}
        self.snapshot = LoadSnapshot()

    def update(self, engine_index: int, running: int, waiting: int, kv_usage: float) -> None:
        self._per_engine[engine_index] = LoadSnapshot(running, waiting, kv_usage)
        snaps = self._per_engine.values()
        self.snapshot = LoadSnapshot(
            running_requests=sum(s.running_requests for s in snaps),
            waiting_requests=sum(s.waiting_requests for s in snaps),
            kv_cache_usage=max(s.kv_cache_usage for s in snaps),
        )

    def stat_logger_factory(self) -> Any:
        from vllm.v1.metrics.loggers import StatLoggerBase

        board = self

        class LoadStatLogger(StatLoggerBase):
            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                self.engine_index = engine_index

            def record(
                self,
                scheduler_stats: Any,
                iteration_stats: Any,
                mm_cache_stats: Any = None,
                engine_idx: int = 0,
            ) -> None:
                if scheduler_stats is not None:
                    board.update(
                        engine_idx,
                        scheduler_stats.num_running_reqs,
                        scheduler_stats.num_waiting_reqs + scheduler_stats.num_skipped_waiting_reqs,
                        scheduler_stats.kv_cache_usage,
                    )

            def log_engine_initialized(self) -> None:
                pass

        return LoadStatLogger


def _translate(exc: Exception) -> Exception:
    """vLLM's exceptions -> the servicer's (see errors.py for the status codes)."""
    from vllm.exceptions import GracefulHTTPError, VLLMClientError
    from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError

    if isinstance(exc, EngineDeadError):
        return EngineUnavailable("vLLM engine is dead (EngineDeadError); retry on another worker")
    if isinstance(exc, GracefulHTTPError):
        return Overloaded(exc.message)
    if isinstance(exc, (VLLMClientError, ValueError, TypeError)):
        return InvalidRequest(str(exc))
    if isinstance(exc, EngineGenerateError) and isinstance(
        exc.__cause__, (VLLMClientError, ValueError, TypeError)
    ):
        return InvalidRequest(str(exc.__cause__))
    return exc


def _reraise(exc: Exception) -> NoReturn:
    translated = _translate(exc)
    if translated is exc:
        raise exc
    raise translated from exc


class VllmEngine:
    """The engine protocol over a running vLLM AsyncLLM."""

    def __init__(self, llm: AsyncLLM, board: LoadBoard) -> None:
        import vllm

        self._llm = llm
        self._board = board
        vllm_config = llm.vllm_config
        model_config = vllm_config.model_config
        self._max_model_len = model_config.max_model_len
        self._model_defaults = model_config.get_diff_sampling_param()
        tokenizer = llm.get_tokenizer() if not model_config.skip_tokenizer_init else None
        eos_ids = set()
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos_ids.add(tokenizer.eos_token_id)
        generation_eos = model_config.try_get_generation_config().get("eos_token_id")
        if generation_eos is not None:
            eos_ids.update([generation_eos] if isinstance(generation_eos, int) else generation_eos)
        served = model_config.served_model_name or model_config.model
        self._facts = ModelFacts(
            model_name=model_config.model,
            served_model_name=served if isinstance(served, str) else served[0],
            max_model_len=model_config.max_model_len,
            vocab_size=model_config.get_vocab_size(),
            dp_size=vllm_config.parallel_config.data_parallel_size,
            block_size=vllm_config.cache_config.block_size,
            eos_token_ids=tuple(sorted(eos_ids)),
            engine="vllm",
            engine_version=vllm.__version__,
        )
        if self._model_defaults:
            logger.info(
                "Model generation-config defaults for unset fields: %s", self._model_defaults
            )

    @classmethod
    def from_engine_args(cls, engine_args: AsyncEngineArgs) -> VllmEngine:
        """Start an AsyncLLM (spawns the engine-core process) wired to our load board."""
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM

        board = LoadBoard()
        if engine_args.disable_log_stats:
            logger.warning(
                "--disable-log-stats also stops the scheduler statistics behind "
                "WorkerMetrics; keeping stats on"
            )
        vllm_config = engine_args.create_engine_config(UsageContext.OPENAI_API_SERVER)
        llm = AsyncLLM.from_vllm_config(
            vllm_config,
            usage_context=UsageContext.OPENAI_API_SERVER,
            stat_loggers=[board.stat_logger_factory()],
            enable_log_requests=engine_args.enable_log_requests,
            disable_log_stats=False,
        )
        return cls(llm, board)

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

    async def check_health(self) -> None:
        try:
            await self._llm.check_health()
        except Exception as exc:
            raise EngineUnavailable(f"vLLM engine health check failed: {exc}") from exc

    async def reset_prefix_cache(self) -> bool:
        if self._llm.errored:
            raise EngineUnavailable("vLLM engine is dead; cannot reset its prefix cache")
        try:
            return await self._llm.reset_prefix_cache()
        except Exception as exc:
            _reraise(exc)

    async def abort(self, request_id: str) -> None:
        if not self._llm.errored:
            await self._llm.abort(request_id)

    async def shutdown(self) -> None:
        self._llm.shutdown()

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[EngineStep, None]:
        ids = request.prompt_token_ids
        options = request.sampling
        try:
            params = build_sampling_params(
                options,
                model_defaults=self._model_defaults,
                prompt_len=len(ids) if ids is not None else None,
                max_model_len=self._max_model_len,
                detokenize=request.detokenize,
            )
        except Exception as exc:
            _reraise(exc)
        prompt: Any
        if ids is not None:
            # Rendered as vLLM's own completions server does: no tokenizer work and no
            # thread-pool hop for a prompt that is already token ids.
            prompt = self._llm.renderer.process_for_engine(
                {"prompt_token_ids": ids}, arrival_time=time.time()
            )
        else:
            prompt = {"prompt": request.prompt_text}  # tokenized by the engine
        top_k = options.logprobs if options.logprobs is not None and options.logprobs > 0 else 0
        want_logprobs = options.logprobs is not None
        produced = 0
        last_token: int | None = None
        outputs = self._llm.generate(
            prompt, params, request.request_id, data_parallel_rank=request.dp_rank
        )
        try:
            async for out in outputs:
                completion = out.outputs[0]
                token_ids = list(completion.token_ids)
                produced += len(token_ids)
                if token_ids:
                    last_token = token_ids[-1]
                stop_reason = completion.stop_reason
                if completion.finish_reason == "stop" and stop_reason is None:
                    stop_reason = last_token  # EOS: report the EOS id that ended it
                yield EngineStep(
                    token_ids=token_ids,
                    text=completion.text,
                    finished=out.finished,
                    finish_reason=completion.finish_reason,
                    stop_reason=stop_reason,
                    prompt_tokens=len(out.prompt_token_ids or ()),
                    completion_tokens=produced,
                    cached_tokens=out.num_cached_tokens or 0,
                    logprobs=convert_logprobs(token_ids, completion.logprobs, top_k)
                    if want_logprobs
                    else None,
                )
        except Exception as exc:
            _reraise(exc)
        finally:
            # Closing vLLM's generator early aborts the request inside the engine.
            await outputs.aclose()
