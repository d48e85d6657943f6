"""The engine protocol every contract is written against (vLLM's and the mock's adapters)."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any, Literal, Protocol, runtime_checkable

from prometheus_client.registry import Collector

from .direct import DirectReceiver
from .types import (
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
)

# The refusals of a weight update an engine cannot take (vLLM's Rust front end's words).
NO_WEIGHT_TRANSFER = "weight transfer is not configured; start vLLM with --weight-transfer-config"
NO_DRAFT_MODEL = "draft weight updates require a configured speculative draft model"

# What happens to requests in flight when the engine pauses (vLLM's PauseMode).
PauseMode = Literal["abort", "wait", "keep"]


@runtime_checkable
class AsyncEngine(Protocol):
    """What the servicers need from an engine.

    Failures are raised as `vllm_router.errors` exceptions: InvalidRequest for
    input the engine rejects, EngineUnavailable once the engine is dead. Anything
    else is treated as a bug (INTERNAL).
    """

    @property
    def facts(self) -> ModelFacts: ...

    @property
    def errored(self) -> bool: ...

    async def tokenize(self, text: str) -> list[int]:
        """The prompt token ids the engine would use for `text` (special tokens added)."""
        ...

    def generate(
        self, request: GenerationRequest, *, receiver: DirectReceiver | None = None
    ) -> AsyncGenerator[EngineStep, None]:
        """Yield one EngineStep per engine step; the last one has finished=True.

        `request.prompt_token_ids` is set (text prompts are tokenized first).
        Closing the iterator early aborts the request in the engine.

        `receiver`: the engine may give a plain step (new token ids only) to it direct,
        from its output loop, instead of yielding it, by the rule of direct.py (which
        requests and which steps: never the first or last, only while the consumer waits
        and nothing is buffered; a step it refuses is yielded as any); later steps'
        `completion_tokens` count what it took. An engine may ignore it.
        """
        ...

    def check_sampling(self, request: GenerationRequest) -> None:
        """Raise InvalidRequest for sampling values the engine rejects, with its message."""
        ...

    async def abort(self, request_id: str) -> None:
        """Stop a request; its stream then ends with finish_reason "abort"."""
        ...

    async def check_health(self) -> None:
        """Raise EngineUnavailable when the engine cannot serve."""
        ...

    async def reset_prefix_cache(self) -> bool: ...

    def load(self) -> LoadSnapshot:
        """All ranks together: for the WorkerMetrics that ride on responses."""
        ...

    def loads(self) -> list[RankLoad]:
        """Per data-parallel rank, in rank order."""
        ...

    def progress(self) -> EngineProgress:
        """Whether the engine has work and when it last made a step; cheap, never a call
        into the engine (it must answer while the engine is stuck)."""
        ...

    async def embed(self, request_id: str, prompt_token_ids: list[int]) -> Embedding:
        """The pooled embedding of a prompt (pooling models only)."""
        ...

    async def tokenizer_files(self) -> list[tuple[str, bytes]]:
        """(file name, bytes) of every tokenizer-related file the engine loaded."""
        ...

    async def list_lora_adapters(self) -> list[LoraAdapter]: ...

    async def load_lora_adapter(self, name: str, path: str) -> None: ...

    async def unload_lora_adapter(self, name: str) -> None: ...

    def kv_events(self) -> AsyncGenerator[KvEventBatch, None]:
        """The engine's prefix-cache events as they happen; NotConfigured when not published."""
        ...

    def kv_event_sources(self) -> list[KvEventSource]:
        """The engine's own KV-event publishers, one per data-parallel rank (empty when it
        publishes none, or none a subscriber here could reach)."""
        ...

    async def pause(self, mode: PauseMode, clear_cache: bool) -> None:
        """Stop scheduling: requests in flight are aborted, run to their end (wait) or
        frozen until `resume` (keep); new ones queue."""
        ...

    async def resume(self) -> None: ...

    async def is_paused(self) -> bool: ...

    async def sleep(self, level: int, mode: PauseMode, *, reset_connector: bool = True) -> None:
        """Pause scheduling (level 0), and offload the weights (1) or free them (2) with the
        KV cache, clearing the KV connector's cache too unless `reset_connector` is false
        (Unsupported where the engine cannot keep it); NotConfigured without sleep mode."""
        ...

    async def wake_up(self, tags: list[str] | None) -> None: ...

    async def is_sleeping(self) -> bool: ...

    async def weight_version(self) -> str:
        """The version of the weights being served (vLLM's weight version)."""
        ...

    async def set_weight_version(self, version: str) -> None: ...

    # An RL trainer's weight update, in vLLM's order: init (once per trainer connection),
    # start (or start a draft model's), update (one chunk or many), finish (with the version
    # the new weights are, if given). Each refuses NotConfigured on an engine started without
    # a weight-transfer backend; the engine's own refusals (out of order, a backend that
    # fails) are EngineOperationFailed. None pauses generation: the caller chooses
    # (`pause`, then the update, then `resume`).

    async def init_weight_transfer(self, init_info: dict[str, Any]) -> None: ...

    async def start_weight_update(self, *, draft: bool) -> None: ...

    async def update_weights(self, update_info: dict[str, Any]) -> None: ...

    async def finish_weight_update(self, version: str | None) -> None: ...

    async def start_profile(self) -> None:
        """Start the engine's profiler; NotConfigured when none was configured."""
        ...

    async def stop_profile(self) -> None: ...

    def prometheus_registry(self) -> Collector | None:
        """The engine's own Prometheus series (vLLM's `vllm:*`), or None if it has none."""
        ...

    async def shutdown(self) -> None: ...
