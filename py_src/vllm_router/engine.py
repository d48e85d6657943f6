"""The engine protocol the servicer is written against, and the neutral types it speaks.

Both adapters (`vllm_engine.VllmEngine` over vLLM's AsyncLLM and
`mock_engine.MockAsyncEngine`) implement `AsyncEngine`. Nothing here imports vLLM.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable


@dataclass(frozen=True, slots=True)
class SamplingOptions:
    """Sampling fields as the client sent them; None means "unset, use the default"."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    max_tokens: int | None = None
    min_tokens: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One validated generation request. Exactly one of the two prompts is set."""

    request_id: str
    prompt_token_ids: list[int] | None
    prompt_text: str | None
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    dp_rank: int | None = None
    detokenize: bool = True


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    # (token id, logprob) of the most likely tokens, most likely first.
    top: tuple[tuple[int, float], ...] = ()


@dataclass(slots=True)
class EngineStep:
    """What one engine step produced for one request (only what is new)."""

    token_ids: list[int]
    text: str
    finished: bool
    # "stop" | "length" | "abort" on the finished step.
    finish_reason: str | None = None
    # What matched when finish_reason is "stop": the stop string, or the token id
    # that ended it (a stop token id or the EOS id). None for other finishes.
    stop_reason: int | str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0  # cumulative
    cached_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None


@dataclass(frozen=True, slots=True)
class ModelFacts:
    model_name: str
    served_model_name: str
    max_model_len: int
    vocab_size: int
    dp_size: int
    block_size: int
    eos_token_ids: tuple[int, ...]
    engine: str
    engine_version: str


@dataclass(frozen=True, slots=True)
class LoadSnapshot:
    """The scheduler's view after its latest step."""

    running_requests: int = 0
    waiting_requests: int = 0
    kv_cache_usage: float = 0.0  # fraction, 0..1


@runtime_checkable
class AsyncEngine(Protocol):
    """What the servicer needs from an engine.

    Failures are raised as `vllm_router.errors` exceptions: InvalidRequest for
    input the engine rejects, EngineUnavailable once the engine is dead.
    """

    @property
    def facts(self) -> ModelFacts: ...

    @property
    def errored(self) -> bool: ...

    def generate(self, request: GenerationRequest) -> AsyncGenerator[EngineStep, None]:
        """Yield one EngineStep per engine step; the last one has finished=True.

        Closing the iterator early aborts the request in the engine.
        """
        ...

    async def abort(self, request_id: str) -> None:
        """Stop a request; its stream then ends with finish_reason "abort"."""
        ...

    async def check_health(self) -> None:
        """Raise EngineUnavailable when the engine cannot serve."""
        ...

    async def reset_prefix_cache(self) -> bool: ...

    def load(self) -> LoadSnapshot: ...

    async def shutdown(self) -> None: ...
