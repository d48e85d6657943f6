"""The neutral types between gRPC contracts and engines (no gRPC, no vLLM).

`SamplingOptions` is the one declaration of the sampling fields: contracts convert
their messages into it field by field (by name), engine adapters read it field by
field, and a test fails when a contract field has no counterpart here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from .media_types import MediaItem, ProcessedMedia

# Why a request ended, as vLLM names it (its FinishReason enum, as strings): `error` is a
# request-level failure (e.g. a KV-cache load that failed in a disaggregated deployment),
# `repetition` a repeating pattern vLLM's repetition detection found.
FinishReason = Literal["stop", "length", "abort", "error", "repetition"]
FINISH_REASONS: frozenset[str] = frozenset(FinishReason.__args__)  # type: ignore[attr-defined]

# Field metadata key: the value vLLM's OpenAI server uses for an unset field when
# the model's generation config has none (CompletionRequest's defaults). Fields
# with it take the model's generation-config value first.
NEUTRAL_DEFAULT = "neutral_default"


def _model_default(neutral: float) -> Any:
    return field(default=None, metadata={NEUTRAL_DEFAULT: neutral})


@dataclass(frozen=True, slots=True)
class StructuredOutputs:
    """One output constraint (exactly one of the first six), as vLLM's StructuredOutputsParams."""

    json: str | None = None  # a JSON Schema, as text
    regex: str | None = None
    grammar: str | None = None
    choice: tuple[str, ...] | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None


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
    # Most likely alternatives returned with each token's logprob (-1: the whole
    # vocabulary); None: no logprobs.
    logprobs: int | None = None
    # These tokens' logprobs at every generated position, whatever their rank.
    logprob_token_ids: tuple[int, ...] = ()
    n: int | None = None
    logit_bias: Mapping[int, float] | None = None
    allowed_token_ids: tuple[int, ...] = ()
    bad_words: tuple[str, ...] = ()
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputs | None = None
    spaces_between_special_tokens: bool | None = None
    # Emit a step's output only every this many tokens (first and last always at once).
    stream_interval: int | None = None
    # Tokens the model may think for before the engine closes its reasoning (None: no
    # limit); only an engine with a reasoning configuration applies it.
    thinking_token_budget: int | None = None


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
    lora_name: str | None = None  # None: the base model
    priority: int = 0
    # W3C trace context (traceparent, tracestate) for the engine's spans.
    trace_headers: Mapping[str, str] | None = None
    # A KV connector's parameters for prefill/decode disaggregation, passed to vLLM as is.
    kv_transfer_params: Mapping[str, Any] | None = None
    # A max_tokens beyond the room the prompt leaves in the context: True generates until the
    # context is full (finish "length", as vLLM's --grpc server); False refuses the request.
    fill_context: bool = False
    # The contract's name for the prompt field, for the messages of the prompt checks.
    prompt_field: str = "prompt_token_ids"
    # Images and other media, in the order of their placeholders in the prompt; or, from a
    # router that ran the processor itself, its outputs.
    media: tuple[MediaItem, ...] = ()
    processed_media: tuple[ProcessedMedia, ...] = ()
    media_field: str = "multimodal_data"
    # Mixed into the prefix-cache hashes: only requests with the same salt share blocks.
    cache_salt: str | None = None
    # Compute the whole prompt: read nothing from the prefix cache.
    skip_prefix_cache: bool = False
    # The caller's session (vLLM's session_id on the engine request).
    session_id: str | None = None
    # Where a structured-output constraint starts on an engine with a reasoning parser:
    # True from the first token (reasoning is over), False after the reasoning ends, None as
    # the engine reads it from the prompt; and the parser's chat-template keywords.
    reasoning_ended: bool | None = None
    reasoning_kwargs: Mapping[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    # (token id, logprob) of the most likely tokens, most likely first (or of the tokens
    # asked for by id, in the order asked).
    top: tuple[tuple[int, float], ...] = ()
    # The token's rank in the distribution (1: the most likely); None where unknown.
    rank: int | None = None
    # Each `top` entry's rank, where the engine reports them.
    top_ranks: tuple[int, ...] = ()


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
    # Which of the request's n samples this step belongs to.
    index: int = 0
    # On the first step of sample 0, when asked for: one entry per prompt token
    # (the first has logprob NaN: nothing precedes it).
    prompt_logprobs: list[TokenLogprob] | None = None
    # On the finished step: what the KV connector returns (a prefill side's handle).
    kv_transfer_params: Mapping[str, Any] | None = None
    # With finish_reason "error": what the engine said about it.
    error: str | None = None
    # On the finished step, with speculative decoding and the engine's per-request counts
    # (vLLM's --per-request-spec-decode-metrics): the draft tokens proposed for this sample
    # and those the model accepted. None: the engine has no such counts for it.
    spec_decode: SpecDecodeCounts | None = None


@dataclass(frozen=True, slots=True)
class SpecDecodeCounts:
    """One sample's speculative decoding, as vLLM counts it per request."""

    draft_tokens: int
    accepted_tokens: int


def one_plain_sample(options: SamplingOptions, samples: int) -> bool:
    """One sample and no logprobs of any kind: what the engine makes per step is only new
    token ids (and text). Such requests skip vLLM's RequestOutput (engine/vllm/lean.py),
    and, token-only and streamed at every step, may have their plain steps go direct
    (direct.py)."""
    return (
        samples == 1
        and options.logprobs is None
        and not options.logprob_token_ids
        and options.prompt_logprobs is None
    )


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
    max_num_seqs: int = 0
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    architectures: tuple[str, ...] = ()
    is_generation: bool = True
    # Generation-config values applied to unset sampling fields.
    default_sampling_params: Mapping[str, Any] = field(default_factory=dict)
    supports_priority: bool = False  # --scheduling-policy priority
    supports_lora: bool = False  # --enable-lora
    tokenizer_path: str = ""
    model_type: str = ""  # the Hugging Face config's model_type, e.g. "llama"
    # Prefill/decode pairing: the KV connector, this worker's role in it and its engine id
    # ("" without --kv-transfer-config), and the dtypes a pair must share.
    kv_connector: str = ""
    kv_role: str = ""
    kv_engine_id: str = ""
    kv_cache_dtype: str = ""
    model_dtype: str = ""  # e.g. "torch.bfloat16"
    # Structured outputs on a prompt that ends inside the model's thinking: the engine's
    # reasoning parser ("" none), and whether a request's grammar waits for the parser to
    # see the thought's end (False: it applies from the first token; None: unknown).
    reasoning_parser: str = ""
    grammar_after_reasoning: bool | None = None
    # The engine runs a reasoning configuration (--reasoning-parser / --reasoning-config):
    # it applies a request's thinking-token budget.
    thinking_budget: bool = False
    # Media the model takes: modality -> items per prompt at most (--limit-mm-per-prompt);
    # empty for a text-only model.
    media_limits: Mapping[str, int] = field(default_factory=dict)
    # Where media URLs may point (vLLM's --allowed-media-domains / --allowed-local-media-path).
    allowed_media_domains: tuple[str, ...] = ()
    allowed_local_media_path: str = ""
    # The engine's shape, as a router reads it (0: unknown).
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    total_kv_blocks: int = 0  # per rank
    max_batched_tokens: int = 0
    max_loras: int = 0
    sleep_mode: bool = False  # --enable-sleep-mode
    weight_transfer_backend: str = ""  # --weight-transfer-config ("" without)
    # Weight updates for a speculative draft model (a backend and a draft model).
    draft_weight_updates: bool = False
    instance_id: str = ""  # the engine's own id, stable for its life


@dataclass(frozen=True, slots=True)
class RankLoad:
    """One data-parallel rank's scheduler figures, and when they were taken (unix time).

    `measured_at` None: the rank has reported nothing yet; its figures are unknown (the
    zeros are placeholders), never to be read as an idle rank.
    """

    dp_rank: int
    running_requests: int
    waiting_requests: int
    kv_cache_usage: float  # fraction, 0..1
    measured_at: float | None


@dataclass(frozen=True, slots=True)
class EngineProgress:
    """Whether the engine has work, and when it last showed it was doing it: what the
    progress watchdog (core.progress) reads to tell a stuck engine from a slow one.

    `busy`: requests are running or waiting in the engine (not those it is holding on
    purpose: paused or asleep). `last_step`: monotonic time of its latest step, or of
    its going from idle to busy or being released from a hold if later; None when the
    engine cannot tell. `held`: paused or asleep on purpose, or a call to make it so (or
    to release it) has not settled: nothing it owes is judged overdue.
    """

    busy: bool
    last_step: float | None
    held: bool = False


@dataclass(frozen=True, slots=True)
class Embedding:
    values: list[float]
    prompt_tokens: int


@dataclass(frozen=True, slots=True)
class LoraAdapter:
    name: str
    path: str
    lora_id: int = 0  # the engine's id for it (0: unknown)


@dataclass(frozen=True, slots=True)
class KvEventSource:
    """Where a subscriber reads one data-parallel rank's KV-cache events itself (the
    engine's own publisher), and how they are framed."""

    endpoint: str  # tcp://host:port or ipc://path
    topic: str
    dp_rank: int
    replay_endpoint: str = ""
    buffer_steps: int = 0
    hwm: int = 0
    max_queue_size: int = 0


@dataclass(frozen=True, slots=True)
class KvBlocksStored:
    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None


@dataclass(frozen=True, slots=True)
class KvBlocksRemoved:
    block_hashes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class KvCacheCleared:
    pass


@dataclass(frozen=True, slots=True)
class KvEventBatch:
    """The prefix-cache changes one engine step made (hashes as signed 64-bit integers)."""

    sequence: int
    timestamp: float
    dp_rank: int | None
    events: tuple[KvBlocksStored | KvBlocksRemoved | KvCacheCleared, ...]


@dataclass(frozen=True, slots=True)
class LoadSnapshot:
    """The scheduler's view after its latest step."""

    running_requests: int = 0
    waiting_requests: int = 0
    kv_cache_usage: float = 0.0  # fraction, 0..1
