"""A typed asyncio client of a vllm.engine.v1 worker, and the `vllm-servicer-client` CLI.

The names below are imported on first use (PEP 562): `vllm-servicer-client --help`, which
imports this package for its `cli` module, then costs no gRPC import.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .errors import (
        AlreadyExistsError,
        AuthenticationError,
        DeadlineError,
        InvalidRequestError,
        NotFoundError,
        OverloadedError,
        UnavailableError,
        UnsupportedError,
        WorkerError,
    )
    from .worker import Tls, WorkerClient

__all__ = [
    "AlreadyExistsError",
    "AuthenticationError",
    "DeadlineError",
    "InvalidRequestError",
    "NotFoundError",
    "OverloadedError",
    "Tls",
    "UnavailableError",
    "UnsupportedError",
    "WorkerClient",
    "WorkerError",
]
# The module each name lives in.
_HOMES = {name: "worker" if name in ("Tls", "WorkerClient") else "errors" for name in __all__}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{home}", __name__), name)
    globals()[name] = value  # once: later lookups do not come here
    return value
