"""The one mapping from failures to gRPC status codes.

Client mistakes and known conditions are raised as the `ServicerError` subclasses
below, at the place that detects them (request conversion, the request table, the
engine adapters translating their engine's own errors). Anything else is a bug in
this server: it becomes INTERNAL and is logged with its traceback, so a bug never
looks like a client mistake.
"""

from __future__ import annotations

import grpc

_CODE_BY_NUMBER = {status.value[0]: status for status in grpc.StatusCode}


def status_code(number: int) -> grpc.StatusCode:
    """The gRPC status code with this number (UNKNOWN for a number gRPC does not define)."""
    return _CODE_BY_NUMBER.get(number, grpc.StatusCode.UNKNOWN)


class ServicerError(Exception):
    """A failure with a known gRPC status."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidRequest(ServicerError):
    """The request itself is wrong; retrying it anywhere fails the same way."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class Unsupported(ServicerError):
    """A well-formed request for a feature this server does not implement."""

    code = grpc.StatusCode.UNIMPLEMENTED


class MediaRefused(ServicerError):
    """A media URL this worker's rules do not allow it to fetch (a host or path not
    allowed by the operator)."""

    code = grpc.StatusCode.PERMISSION_DENIED


class PathRefused(ServicerError):
    """A path a remote caller named (a LoRA adapter, a weights file) that lies outside what
    this worker's operator allowed; nothing was read."""

    code = grpc.StatusCode.PERMISSION_DENIED


class OutOfOrder(ServicerError):
    """A call that the state it finds does not allow (a weight update's step out of its
    sequence); nothing was done: the engine was not called."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class NotFound(ServicerError):
    """A named thing (a LoRA adapter) that this worker does not have."""

    code = grpc.StatusCode.NOT_FOUND


class NotConfigured(ServicerError):
    """The worker is not set up for this (generation on a pooling model, LoRA without
    --enable-lora, ...): retrying here fails the same way; another worker may serve it."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class DuplicateRequest(ServicerError):
    """A request id already in flight on this worker (or a LoRA name already loaded)."""

    code = grpc.StatusCode.ALREADY_EXISTS


class Overloaded(ServicerError):
    """An admission limit was hit; another worker (or later) may accept it."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class EngineUnavailable(ServicerError):
    """The engine is dead or the server is draining: retry on another worker."""

    code = grpc.StatusCode.UNAVAILABLE


class EngineDead(EngineUnavailable):
    """The engine itself is gone (its process died): this worker serves nothing more.

    Engine adapters raise it; the serving core turns the worker NOT_SERVING on the
    first one it sees, before the failing RPC's status goes out.
    """


class MediaUnavailable(ServicerError):
    """A media URL could not be fetched now (timeout, connection, a 5xx): another try,
    here or on another worker, may succeed."""

    code = grpc.StatusCode.UNAVAILABLE


class RequestFailed(EngineUnavailable):
    """The engine ended this one request with an error (vLLM's `error` finish, e.g. a KV
    transfer that failed): the request may succeed on another worker, this one serves on."""


class EngineOperationFailed(ServicerError):
    """The engine refused or failed an operation it was asked for (a weight-transfer
    backend's error); the message is the engine's own. INTERNAL, as vLLM's Rust front end
    answers it, but not a bug in this server.

    For a weight-update step, what it left of the served model (core/weight_updates.py):
    `model_whole` True when nothing was loaded (the model is as it was), False when it may
    be part-loaded, None when the engine cannot tell; `restartable` when a new complete
    update can make it whole again on this engine."""

    code = grpc.StatusCode.INTERNAL

    def __init__(
        self, message: str, *, model_whole: bool | None = None, restartable: bool = False
    ) -> None:
        super().__init__(message)
        self.model_whole = model_whole
        self.restartable = restartable


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """(status code, message) for an exception raised while serving an RPC.

    Only `ServicerError`s carry a client-facing code; everything else is INTERNAL.
    """
    if isinstance(exc, ServicerError):
        return exc.code, exc.message
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"
