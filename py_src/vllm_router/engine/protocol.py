"""The engine protocol every contract is written against (vLLM's and the mock's adapters)."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Protocol, runtime_checkable

from .types import EngineStep, GenerationRequest, LoadSnapshot, ModelFacts


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

    def generate(self, request: GenerationRequest) -> AsyncGenerator[EngineStep, None]:
        """Yield one EngineStep per engine step; the last one has finished=True.

        `request.prompt_token_ids` is set (text prompts are tokenized first).
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
