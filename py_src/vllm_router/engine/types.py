"""The neutral types between gRPC contracts and engines (no gRPC, no vLLM).

`SamplingOptions` is the one declaration of the sampling fields: contracts convert
their messages into it field by field (by name), engine adapters read it field by
field, and a test fails when a contract field has no counterpart here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

# Why a request ended, as vLLM names it.
FinishReason = Literal["stop", "length", "abort"]

# Field metadata key: the value vLLM's OpenAI server uses for an unset field when
# the model's generation config has none (CompletionRequest's defaults). Fields
# with it take the model's generation-config value first.
NEUTRAL_DEFAULT = "neutral_default"


def _model_default(neutral: float) -> Any:
    return field(default=None, metadata={NEUTRAL_DEFAULT: neutral})


@dataclass(frozen=True, slots=True)
class SamplingOptions:
    """Sampling fields as the client sent them; None means "unset, use the default"."""

    temperature: float | None = _model_default(1.0)
    top_p: float | None = _model_default(1.0)
    top_k: int | None = _model_default(0)
    min_p: float | None = _model_default(0.0)
    frequency_penalty: float | None = _model_default(0.0)
    presence_penalty: float | None = _model_default(0.0)
    repetition_penalty: float | None = _model_default(1.0)
    max_tokens: int | None = None
    min_tokens: int | None = None
    seed: int | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    # Most likely alternatives returned with each token's logprob; None: no logprobs.
    logprobs: int | None = None


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One generation request. Exactly one of the two prompts is set.

    A text prompt is tokenized (`AsyncEngine.tokenize`) before admission, so every
    prompt check applies to it as to token ids and engines only ever see ids.
    """

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
    # Set on the finished step.
    finish_reason: FinishReason | None = None
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
