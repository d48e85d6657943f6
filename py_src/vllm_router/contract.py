"""Rules of the vllm.engine.v1 contract that are code, not messages (used by both ends)."""

from __future__ import annotations

import hashlib

# Where a worker listens unless told otherwise (the server and the client CLI agree).
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 50051
DEFAULT_ADDRESS = f"{DEFAULT_HOST}:{DEFAULT_PORT}"
# Largest message either end sends or accepts by default.
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# Where both the server and the client CLI read the shared API key from.
API_KEY_ENV = "VLLM_SERVICER_API_KEY"


def tokenizer_digest(files: list[tuple[str, bytes]]) -> str:
    """GetTokenizerResponse.sha256: SHA-256 over every file in stream order, each as its
    UTF-8 name, a NUL byte, its size as 8 bytes big-endian, then its bytes."""
    digest = hashlib.sha256()
    for name, data in files:
        digest.update(name.encode() + b"\0" + len(data).to_bytes(8, "big"))
        digest.update(data)
    return digest.hexdigest()
