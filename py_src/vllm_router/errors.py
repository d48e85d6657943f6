"""The one mapping from failures to gRPC status codes.

Client mistakes and known conditions are raised as the `ServicerError` subclasses
below, at the place that detects them (request conversion, the request table, the
engine adapters translating their engine's own errors). Anything else is a bug in
this server: it becomes INTERNAL and is logged with its traceback, so a bug never
looks like a client mistake.
"""

from __future__ import annotations

import grpc


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


class DuplicateRequest(ServicerError):
    """A request id that is already in flight on this worker."""

    code = grpc.StatusCode.ALREADY_EXISTS


class Overloaded(ServicerError):
    """An admission limit was hit; another worker (or later) may accept it."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class EngineUnavailable(ServicerError):
    """The engine is dead or the server is draining: retry on another worker."""

    code = grpc.StatusCode.UNAVAILABLE


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """(status code, message) for an exception raised while serving an RPC.

    Only `ServicerError`s carry a client-facing code; everything else is INTERNAL.
    """
    if isinstance(exc, ServicerError):
        return exc.code, exc.message
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"
