"""MockConfig: the mock engine's settings, declared once (the CLI derives --mock-<name>)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..engine import FinishReason

# What `fault_finish_reason` may name: vLLM's finish reasons that are no ordinary answer.
FAULT_FINISHES: dict[str, FinishReason | None] = {
    "": None,
    "error": "error",
    "repetition": "repetition",
}


@dataclass(frozen=True)
class MockConfig:
    """The mock's settings; `vllm-servicer --mock-<name>` flags are derived from these fields."""

    model_name: str = field(default="mock-model", metadata={"help": "served model name"})
    vocab_size: int = 32000
    max_model_len: int = 4096
    eos_token_id: int = 2
    tokens_per_step: int = field(default=1, metadata={"help": "tokens each engine step makes"})
    step_delay: float = field(default=0.0, metadata={"help": "seconds between engine steps"})
    prefill_delay: float = field(
        default=0.0, metadata={"help": "seconds before a request's first step (its prefill)"}
    )
    stream_interval: int = field(
        default=1,
        metadata={
            "help": "steps merged per streamed step for every request (vLLM's --stream-interval)"
        },
    )
    max_num_seqs: int = field(default=256, metadata={"help": "requests running at once"})
    block_size: int = 16
    kv_cache_tokens: int = 262144
    dp_size: int = 1
    fault_finish_reason: str = field(
        default="",
        metadata={
            "help": "fault injection: every sample finishes with this engine finish reason "
            "('error' or 'repetition') after its second token (default: none)"
        },
    )
    image_token_id: int = field(
        default=0,
        metadata={"help": "take images, one placeholder of this token id each (0: text only)"},
    )
    max_images: int = field(default=4, metadata={"help": "images per prompt at most"})
    weight_transfer_backend: str = field(
        default="",
        metadata={
            "help": "take RL weight updates as an engine with this backend would "
            "(the mock keeps its outputs; default: none, refused as vLLM refuses)"
        },
    )
    allowed_media_domains: str = field(
        default="", metadata={"help": "hosts media URLs may name, comma-separated (as vLLM's)"}
    )
    allowed_local_media_path: str = field(
        default="", metadata={"help": "directory file: media URLs may name (as vLLM's)"}
    )
    die_after_tokens: int = field(
        default=0,
        metadata={"help": "fault injection: the engine dies after this many tokens (0: never)"},
    )
    stall_after_tokens: int = field(
        default=0,
        metadata={
            "help": "fault injection: the engine stops making steps (alive, stuck) after "
            "this many tokens (0: never)"
        },
    )
    stall_seconds: float = field(
        default=0.0,
        metadata={"help": "how long that stall lasts (0: for good, as a wedged engine)"},
    )

    def __post_init__(self) -> None:
        if self.fault_finish_reason not in FAULT_FINISHES:
            raise ValueError(
                f"fault_finish_reason must be one of {sorted(FAULT_FINISHES)}, "
                f"got {self.fault_finish_reason!r}"
            )
