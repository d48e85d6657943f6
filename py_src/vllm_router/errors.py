"""The one mapping from failures to gRPC status codes.

Engine adapters and request conversion raise the exceptions below; handlers
pass anything they catch to `status_for`. A client mistake is never INTERNAL
or UNKNOWN: only failures nobody anticipated end up there.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

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


class Malformed:
    """Stands in for a request whose bytes did not parse (see MalformedRequestInterceptor)."""

    __slots__ = ("error",)

    def __init__(self, error: Exception) -> None:
        self.error = error

    def invalid(self) -> InvalidRequest:
        return InvalidRequest(f"the request message could not be parsed: {self.error}")


def _tolerant(deserialize: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception as exc:  # protobuf's DecodeError: corrupt bytes, bad UTF-8, ...
            return Malformed(exc)

    return parse


_HANDLER_KINDS: dict[str, Callable[..., grpc.RpcMethodHandler]] = {
    "unary_unary": grpc.unary_unary_rpc_method_handler,
    "unary_stream": grpc.unary_stream_rpc_method_handler,
    "stream_unary": grpc.stream_unary_rpc_method_handler,
    "stream_stream": grpc.stream_stream_rpc_method_handler,
}


def rebuild_handler(
    handler: grpc.RpcMethodHandler,
    *,
    behaviour: Callable[..., Any] | None = None,
    request_deserializer: Callable[[bytes], Any] | None = None,
) -> grpc.RpcMethodHandler:
    """`handler` of the same streaming shape with its behaviour and/or parser replaced."""
    for kind, make in _HANDLER_KINDS.items():
        original = getattr(handler, kind)
        if original is not None:
            return make(
                behaviour or original,
                request_deserializer=request_deserializer or handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
    raise ValueError("handler has no behaviour")


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    """Answer unparsable request bytes with INVALID_ARGUMENT (gRPC itself says UNKNOWN).

    Unary methods are wrapped here. Server-streaming methods of `streaming_service` get
    only the tolerant parser (their handlers check for `Malformed` themselves), so the
    per-message path stays exactly gRPC's own.
    """

    def __init__(self, streaming_service: str) -> None:
        self._streaming_prefix = f"/{streaming_service}/"

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        parse = _tolerant(handler.request_deserializer)
        if handler.unary_unary is not None:
            behaviour = handler.unary_unary

            async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                if isinstance(request, Malformed):
                    invalid = request.invalid()
                    await context.abort(invalid.code, invalid.message)
                return await behaviour(request, context)

            return rebuild_handler(handler, behaviour=unary, request_deserializer=parse)
        if handler.unary_stream is not None and details.method.startswith(self._streaming_prefix):
            return rebuild_handler(handler, request_deserializer=parse)
        return handler
