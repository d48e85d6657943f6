"""Adapter from vLLM's v1 AsyncLLM to the engine protocol, and the load board it feeds.

vLLM is imported lazily: importing this module is cheap and works without vLLM.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any

from ..errors import EngineUnavailable
from .types import EngineStep, GenerationRequest, LoadSnapshot, ModelFacts
from .vllm_params import build_sampling_params, convert_logprobs, reraise

if TYPE_CHECKING:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

logger = logging.getLogger(__name__)


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
            reraise(exc)

    async def abort(self, request_id: str) -> None:
        if not self._llm.errored:
            await self._llm.abort(request_id)

    async def shutdown(self) -> None:
        self._llm.shutdown()

    async def tokenize(self, text: str) -> list[int]:
        """Tokenized as vLLM's completions server does (special tokens added)."""
        renderer = self._llm.renderer
        try:
            prompt = await renderer.tokenize_prompt_async(
                {"prompt": text}, renderer.default_cmpl_tok_params
            )
        except Exception as exc:
            reraise(exc)
        return list(prompt["prompt_token_ids"])  # type: ignore[typeddict-item]

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[EngineStep, None]:
        ids = request.prompt_token_ids
        if ids is None:
            raise ValueError("VllmEngine.generate needs prompt_token_ids (tokenize text first)")
        options = request.sampling
        try:
            params = build_sampling_params(
                options,
                model_defaults=self._model_defaults,
                prompt_len=len(ids),
                max_model_len=self._max_model_len,
                detokenize=request.detokenize,
            )
        except Exception as exc:
            reraise(exc)
        # Rendered as vLLM's own completions server does: no tokenizer work and no
        # thread-pool hop for a prompt that is already token ids.
        prompt = self._llm.renderer.process_for_engine(
            {"prompt_token_ids": ids}, arrival_time=time.time()
        )
        num_top = options.logprobs if options.logprobs is not None and options.logprobs > 0 else 0
        want_logprobs = options.logprobs is not None
        produced = 0
        last_token: int | None = None
        outputs = self._llm.generate(
            prompt, params, request.request_id, data_parallel_rank=request.dp_rank
        )
        try:
            while True:
                # Only vLLM's own call is translated: a failure in the conversion
                # below is a bug of ours and must surface as one (INTERNAL).
                try:
                    out = await outputs.__anext__()
                except StopAsyncIteration:
                    return
                except Exception as exc:
                    reraise(exc)
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
                    finish_reason=completion.finish_reason,  # type: ignore[arg-type]
                    stop_reason=stop_reason,
                    prompt_tokens=len(out.prompt_token_ids or ()),
                    completion_tokens=produced,
                    cached_tokens=out.num_cached_tokens or 0,
                    logprobs=convert_logprobs(token_ids, completion.logprobs, num_top)
                    if want_logprobs
                    else None,
                )
        finally:
            # Closing vLLM's generator early aborts the request inside the engine.
            await outputs.aclose()
