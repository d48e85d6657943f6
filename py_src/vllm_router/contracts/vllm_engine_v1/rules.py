"""Rules of the vllm.engine.v1 contract that are code, not messages (used by both ends)."""

from __future__ import annotations

import hashlib

# GetTokenizer streams each file in chunks of at most this many bytes.
TOKENIZER_CHUNK_BYTES = 1 << 20


def tokenizer_digest(files: list[tuple[str, bytes]]) -> str:
    """GetTokenizerResponse.sha256: SHA-256 over every file in stream order, each as its
    UTF-8 name, a NUL byte, its size as 8 bytes big-endian, then its bytes."""
    digest = hashlib.sha256()
    for name, data in files:
        digest.update(name.encode() + b"\0" + len(data).to_bytes(8, "big"))
        digest.update(data)
    return digest.hexdigest()
