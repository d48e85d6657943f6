"""The one mapping from failures to gRPC status codes.

Engine adapters and request conversion raise the exceptions below; handlers
pass anything they catch to `status_for`. A client mistake is never INTERNAL
or UNKNOWN: only failures nobody anticipated end up there.
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
    """Map an exception raised while serving an RPC to (status code, message)."""
    if isinstance(exc, ServicerError):
        return exc.code, exc.message
    if isinstance(exc, (ValueError, TypeError, OverflowError)):
        # Validation in the engine (vLLM raises ValueError for bad inputs) and
        # protobuf/Python conversions of out-of-range values.
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc) or type(exc).__name__
    if isinstance(exc, NotImplementedError):
        return grpc.StatusCode.UNIMPLEMENTED, str(exc) or "not implemented"
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"
