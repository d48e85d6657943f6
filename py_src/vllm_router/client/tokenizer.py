"""The worker's own tokenizer, fetched once through GetTokenizer and cached by its digest.

Clients tokenize text exactly as the worker does, with no model hub access: the files
are stored under `<cache>/<sha256>/` (the digest GetModelInfo reports), so a second
client of the same model loads them from disk without a fetch.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from ..contracts.vllm_engine_v1.rules import tokenizer_digest
from ..proto import vllm_engine_pb2 as pb


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(os.environ.get("VLLM_SERVICER_TOKENIZER_CACHE", Path(base) / "vllm-servicer"))


async def fetch_files(chunks: AsyncIterator[pb.GetTokenizerResponse]) -> tuple[str, Path]:
    """Store a GetTokenizer stream under its digest (checked); returns (digest, directory)."""
    files: dict[str, bytearray] = {}
    expected = ""
    async for chunk in chunks:
        if chunk.sha256:
            expected = chunk.sha256
            break
        files.setdefault(chunk.file_name, bytearray()).extend(chunk.data)
    ordered = [(name, bytes(data)) for name, data in files.items()]
    actual = tokenizer_digest(ordered)
    if not expected or actual != expected:
        raise ValueError(f"tokenizer files arrived corrupt (sha256 {actual}, sent {expected})")
    return actual, await asyncio.to_thread(_store, actual, ordered)


def _store(digest: str, files: list[tuple[str, bytes]]) -> Path:
    target = cache_root() / "tokenizers" / digest
    if not target.is_dir():
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".partial-"))
        for name, data in files:
            path = staging / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        try:
            staging.rename(target)  # atomic: readers never see half a directory
        except OSError:  # another client stored it meanwhile
            shutil.rmtree(staging, ignore_errors=True)
    return target


def cached_tokenizer(digest: str) -> Path | None:
    path = cache_root() / "tokenizers" / digest
    return path if digest and path.is_dir() else None


def load_tokenizer(directory: Path) -> Any:
    """The tokenizer vLLM itself would build from these files (Hugging Face's)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
