"""A typed asyncio client of a vllm.engine.v1 worker, and the `vllm-servicer-client` CLI."""

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
