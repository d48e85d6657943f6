"""The model's tokenizer files, read from the engine once per server for every contract.

Each contract ships them in its own wire form (our chunked stream with its digest,
vLLM's zip archive with the archive's SHA-256); both derive that form here from the
one file list, so the file set and the bytes behind every digest are the same.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

from ..engine import AsyncEngine

Derived = TypeVar("Derived")
Files = list[tuple[str, bytes]]


class TokenizerFiles:
    """(name, bytes) of the engine's tokenizer files, and values derived from them, cached."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine
        self._files: Files | None = None
        self._derived: dict[Callable[[Files], Any], Any] = {}
        self._lock = asyncio.Lock()

    async def files(self) -> Files:
        """The files; they do not change while serving. Raises what the engine raises
        (Unsupported for an engine without tokenizer files)."""
        if self._files is None:
            async with self._lock:
                if self._files is None:
                    self._files = await self._engine.tokenizer_files()
        return self._files

    async def derive(self, build: Callable[[Files], Derived]) -> Derived:
        """`build(files)`, computed once per `build` (a digest, an archive)."""
        if build not in self._derived:
            files = await self.files()
            self._derived[build] = await asyncio.to_thread(build, files)
        result: Derived = self._derived[build]
        return result
