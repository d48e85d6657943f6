"""Server interceptors' shared machinery, and the one that makes unparsable bytes a status.

gRPC answers request bytes that do not parse with UNKNOWN; a client mistake must be
INVALID_ARGUMENT. `MalformedRequestInterceptor` swaps in a parser that returns
`core.Malformed` instead of raising: handlers decorated with `core.handles_errors`
answer it themselves (so the streaming write path stays exactly gRPC's own), other
services' unary handlers are wrapped here.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from ..core import Malformed, abort_with

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


def _tolerant(deserialize: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception as exc:  # protobuf's DecodeError: corrupt bytes, bad UTF-8, ...
            return Malformed(exc)

    return parse


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    """Unparsable request bytes -> INVALID_ARGUMENT, for every unary-request method."""

    def __init__(self, decorated_services: tuple[str, ...]) -> None:
        # Services whose handlers wear core.handles_errors and answer Malformed themselves.
        self._decorated = tuple(f"/{name}/" for name in decorated_services)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        parse = _tolerant(handler.request_deserializer)
        if details.method.startswith(self._decorated):
            return rebuild_handler(handler, request_deserializer=parse)
        if handler.unary_unary is not None:
            behaviour = handler.unary_unary

            async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                if isinstance(request, Malformed):
                    await abort_with(context, request.invalid())
                return await behaviour(request, context)

            return rebuild_handler(handler, behaviour=unary, request_deserializer=parse)
        return handler
