"""Admission: what a request must pass before it takes a place in the request table.

The model kind (generation or pooling), the serving state (not draining, engine alive),
the prompt (text tokenized the engine's way, then checked against the context window and
--max-prompt-tokens) and its media (checked and fetched last, so a request refused for its
prompt costs no download). Every refusal is counted by cause (`counted`), as the request
table's own refusals (duplicate id, a full worker) are. A contract that needs a text
prompt's ids before the request runs (to echo or truncate them) asks `tokenized`: the
same checks, in the same order, up to the tokenization.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator

from ..engine import AsyncEngine, GenerationRequest
from ..errors import InvalidRequest, NotConfigured, ServicerError
from .health import ServingState
from .media_admission import MediaRules, resolve_media
from .metrics import ServicerMetrics
from .prompts import check_prompt


class Admission:
    def __init__(
        self,
        engine: AsyncEngine,
        state: ServingState,
        *,
        max_prompt_tokens: int = 0,
        metrics: ServicerMetrics | None = None,
        media_rules: MediaRules | None = None,
    ) -> None:
        self._engine = engine
        self._state = state
        self._max_prompt_tokens = max_prompt_tokens
        self._metrics = metrics
        self._media_rules = media_rules or MediaRules.of(engine.facts)

    @contextlib.asynccontextmanager
    async def counted(self) -> AsyncIterator[None]:
        """Count a refusal raised inside the block by its cause (then re-raise it)."""
        try:
            yield
        except ServicerError as exc:
            if self._metrics is not None:
                self._metrics.reject(exc)
            raise

    async def generation(self, request: GenerationRequest) -> GenerationRequest:
        """`request` as the engine takes it (prompt token ids set), or why it may not run."""
        async with self.counted():
            await self._may_generate()
            return await self._checked_prompt(request)

    async def tokenized(self, request: GenerationRequest) -> GenerationRequest:
        """`request` with a text prompt tokenized the engine's way (its ids replace the
        text; the prompt checks are `generation`'s), or why it may not run."""
        async with self.counted():
            await self._may_generate()
            if request.prompt_token_ids is not None:
                return request
            return await self._with_ids(request)

    async def _may_generate(self) -> None:
        if not self._engine.facts.is_generation:
            raise NotConfigured(
                "this worker serves a pooling (embedding) model: use Embed, not generation"
            )
        await self._state.require_serving()

    async def _with_ids(self, request: GenerationRequest) -> GenerationRequest:
        ids = await self._engine.tokenize(request.prompt_text or "")
        return dataclasses.replace(request, prompt_token_ids=ids, prompt_text=None)

    async def embedding(self, prompt_token_ids: list[int]) -> None:
        """Raise why an embedding of `prompt_token_ids` may not run, if it may not."""
        async with self.counted():
            if self._engine.facts.is_generation:
                raise NotConfigured(
                    "this worker serves a generation model: Embed needs a pooling model "
                    "(start the engine with --runner pooling, or --convert embed)"
                )
            await self._state.require_serving()
            check_prompt(
                prompt_token_ids,
                None,
                self._engine.facts,
                max_prompt_tokens=self._max_prompt_tokens,
            )

    async def _checked_prompt(self, request: GenerationRequest) -> GenerationRequest:
        if request.prompt_token_ids is None:
            request = await self._with_ids(request)
            field_name = "prompt_text (tokenized)"
        else:
            field_name = request.prompt_field
        try:
            check_prompt(
                request.prompt_token_ids or [],
                None if request.fill_context else request.sampling.max_tokens,
                self._engine.facts,
                max_prompt_tokens=self._max_prompt_tokens,
                field_name=field_name,
            )
        except InvalidRequest:
            # vLLM validates sampling values before the prompt: a request wrong in both
            # is told about its sampling (only failing requests pay for this check).
            self._engine.check_sampling(request)
            raise
        return await resolve_media(request, self._engine.facts, self._media_rules)
