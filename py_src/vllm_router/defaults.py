"""Defaults the server and the client CLI agree on, declared once."""

from __future__ import annotations

# Where a worker listens unless told otherwise.
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 50051
DEFAULT_ADDRESS = f"{DEFAULT_HOST}:{DEFAULT_PORT}"
# Largest message either end sends or accepts by default.
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# Where both the server and the client CLI read the shared API key from.
API_KEY_ENV = "VLLM_SERVICER_API_KEY"
# ... and the control key: what RPCs that change the worker need (server/security.py).
CONTROL_API_KEY_ENV = "VLLM_SERVICER_CONTROL_API_KEY"
# The one directory the `file` weight-transfer backend may read beneath (engine/vllm/
# file_weights.py): set by the worker's operator, read in every vLLM process.
WEIGHT_FILE_ROOT_ENV = "VLLM_SERVICER_WEIGHT_FILE_ROOT"
