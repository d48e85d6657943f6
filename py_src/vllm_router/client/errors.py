"""Typed errors of the client: each carries the gRPC status code and the server's message."""

from __future__ import annotations

import grpc


class WorkerError(Exception):
    """An RPC to the worker failed; `code` and `details` are the gRPC status."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class InvalidRequestError(WorkerError):
    """The worker refused the request as asked (INVALID_ARGUMENT, OUT_OF_RANGE)."""


class NotFoundError(WorkerError):
    """NOT_FOUND: e.g. an unknown LoRA adapter."""


class AlreadyExistsError(WorkerError):
    """ALREADY_EXISTS: a request id already in flight."""


class UnsupportedError(WorkerError):
    """UNIMPLEMENTED or FAILED_PRECONDITION: this worker cannot do that (as configured)."""


class OverloadedError(WorkerError):
    """RESOURCE_EXHAUSTED: the worker is full (or a message too large); retry elsewhere."""


class UnavailableError(WorkerError):
    """UNAVAILABLE: unreachable, draining, or its engine is dead; retry elsewhere."""


class AuthenticationError(WorkerError):
    """UNAUTHENTICATED or PERMISSION_DENIED: a missing or wrong API key."""


class DeadlineError(WorkerError):
    """DEADLINE_EXCEEDED: the call's timeout passed."""


_BY_CODE: dict[grpc.StatusCode, type[WorkerError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequestError,
    grpc.StatusCode.OUT_OF_RANGE: InvalidRequestError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExistsError,
    grpc.StatusCode.UNIMPLEMENTED: UnsupportedError,
    grpc.StatusCode.FAILED_PRECONDITION: UnsupportedError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: OverloadedError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.UNAUTHENTICATED: AuthenticationError,
    grpc.StatusCode.PERMISSION_DENIED: AuthenticationError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineError,
}


def from_rpc_error(error: grpc.aio.AioRpcError) -> WorkerError:
    """The typed error for a failed call."""
    return from_status(error.code(), error.details() or "")


def from_status(code: grpc.StatusCode, details: str) -> WorkerError:
    """The typed error for a status (of a call, or of one request on a batched stream)."""
    return _BY_CODE.get(code, WorkerError)(code, details or code.name)
