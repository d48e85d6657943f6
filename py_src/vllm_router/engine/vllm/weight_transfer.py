"""RL weight updates on one AsyncLLM: vllm.Control's weight-transfer sequence (init, start,
one update per chunk, finish) through vLLM's own methods, with what this worker adds around
them: the file backend's paths confined before vLLM's workers see them (file_weights.py),
the engine's refusals told as vLLM's Rust front end tells them, and a failed Finish's update
closed in vLLM's workers. The order of the steps is the serving core's (core/weight_updates.py).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from ...errors import (
    EngineOperationFailed,
    InvalidRequest,
    NotConfigured,
    ServicerError,
    Unsupported,
)
from ..protocol import NO_DRAFT_MODEL, NO_WEIGHT_TRANSFER
from ..types import ModelFacts
from .file_weights import NO_ROOT, WeightFileRule

logger = logging.getLogger(__name__)

# The adapter's AsyncLLM call: on a live engine, its failures told as the servicer's errors.
EngineCall = Callable[..., Awaitable[Any]]


class WeightTransfer:
    """The weight-transfer sequence of one engine (`supported`: compat.py found vLLM's API;
    `restartable`: a failed file-backend load can be undone, see file_weights.py)."""

    def __init__(
        self,
        llm: Any,
        facts: ModelFacts,
        call: EngineCall,
        *,
        supported: bool,
        restartable: bool,
    ) -> None:
        self._llm = llm
        self._facts = facts
        self._call = call
        self._supported = supported
        # The file backend's paths, checked here before vLLM's workers check them again.
        self._files = WeightFileRule.of(facts.weight_transfer_backend, restartable=restartable)
        if self._files.applies and self._files.root is None:
            logger.warning("--weight-transfer-config names the file backend: %s", NO_ROOT)

    async def init(self, init_info: dict[str, Any]) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        self._require()
        root = self._files.narrowed(init_info)
        request = WeightTransferInitRequest(init_info=init_info)
        await self._operation("init_weight_transfer_engine", request)
        self._files.root = root

    async def start(self, *, draft: bool) -> None:
        self._require()
        if draft and not self._facts.draft_weight_updates:
            raise NotConfigured(NO_DRAFT_MODEL)
        name = "start_draft_weight_update" if draft else "start_weight_update"
        try:
            await self._operation(name)
        except EngineOperationFailed as exc:
            # The file backend's Start stages nothing and loads nothing.
            raise self._files.outcome(exc, loads=False) from exc

    async def update(self, update_info: dict[str, Any]) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        self._require()
        self._files.check_update(update_info)
        request = WeightTransferUpdateRequest(update_info=update_info)
        try:
            await self._operation("update_weights", request)
        except EngineOperationFailed as exc:
            # The file backend stages a chunk; it loads nothing before Finish.
            raise self._files.outcome(exc, loads=False) from exc

    async def finish(self, version: str | None) -> None:
        self._require()
        try:
            await self._operation("finish_weight_update", weight_version=version)
        except EngineOperationFailed as exc:
            failed = self._files.outcome(exc, loads=True)
            if failed.model_whole is not None or failed.restartable:
                # vLLM's workers keep a failed Finish's update open: close it (nothing is
                # staged any more, so this loads nothing and sets no version).
                await self._close_failed_update()
            raise failed from exc

    async def _close_failed_update(self) -> None:
        try:
            await self._llm.finish_weight_update()
        except Exception as exc:
            logger.warning("Could not close the failed weight update in vLLM's workers: %s", exc)

    def _require(self) -> None:
        if not self._facts.weight_transfer_backend:
            raise NotConfigured(NO_WEIGHT_TRANSFER)
        if not self._supported:
            raise Unsupported(
                f"this vLLM's weight-transfer API is not the one this worker was built for "
                f"(vLLM {self._facts.engine_version}; see the start-up log)"
            )

    async def _operation(self, name: str, *args: Any, **kwargs: Any) -> None:
        """One of AsyncLLM's engine operations; the engine's refusal (its workers' message,
        e.g. an update out of order) is told as vLLM's Rust front end tells it."""
        try:
            await self._call(getattr(self._llm, name), *args, **kwargs)
        except InvalidRequest as exc:  # a worker's ValueError: still the engine's refusal
            raise EngineOperationFailed(f"{name} failed: {exc.message}") from exc
        except ServicerError:
            raise
        except Exception as exc:
            raise EngineOperationFailed(f"{name} failed: {exc}") from exc
