"""LoRA adapters loaded into a vLLM engine, by the names clients use."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ...errors import DuplicateRequest, InvalidRequest, NotConfigured, NotFound
from ..types import LoraAdapter
from .params import reraise

if TYPE_CHECKING:
    from vllm.lora.request import LoRARequest
    from vllm.v1.engine.async_llm import AsyncLLM

NOT_ENABLED = "LoRA is not enabled on this worker (start the engine with --enable-lora)"


def parse_lora_modules(specs: Sequence[str] | None) -> list[LoraAdapter]:
    """`name=path` items of --lora-modules (vLLM's OpenAI server flag)."""
    adapters = []
    for spec in specs or ():
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules takes name=path items, got {spec!r}")
        adapters.append(LoraAdapter(name, path))
    return adapters


class LoraRegistry:
    def __init__(self, llm: AsyncLLM, enabled: bool) -> None:
        self._llm = llm
        self._enabled = enabled
        self._requests: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    def request_for(self, name: str | None) -> LoRARequest | None:
        """vLLM's LoRARequest for a client's lora_name (None: the base model)."""
        if name is None:
            return None
        if not self._enabled:
            raise NotConfigured(NOT_ENABLED)
        found = self._requests.get(name)
        if found is None:
            known = ", ".join(sorted(self._requests)) or "none"
            raise NotFound(f"no LoRA adapter named {name!r} on this worker (loaded: {known})")
        return found

    def adapters(self) -> list[LoraAdapter]:
        return [LoraAdapter(name, r.lora_path, r.lora_int_id) for name, r in self._requests.items()]

    async def load(self, name: str, path: str) -> None:
        from vllm.lora.request import LoRARequest

        if not self._enabled:
            raise NotConfigured(NOT_ENABLED)
        if name in self._requests:
            raise DuplicateRequest(f"a LoRA adapter named {name!r} is already loaded")
        request = LoRARequest(lora_name=name, lora_int_id=next(self._ids), lora_path=path)
        try:
            loaded: Any = await self._llm.add_lora(request)
        except Exception as exc:
            reraise(exc)
        if not loaded:
            raise InvalidRequest(f"vLLM did not load the LoRA adapter at {path!r}")
        self._requests[name] = request

    async def unload(self, name: str) -> None:
        request = self.request_for(name)
        assert request is not None
        try:
            await self._llm.remove_lora(request.lora_int_id)
        except Exception as exc:
            reraise(exc)
        del self._requests[name]
