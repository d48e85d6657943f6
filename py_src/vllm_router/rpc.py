"""RPC error handling in one place: the `handles_errors` decorator every handler wears.

A decorated handler raises; the decorator turns what it raised into the status from
`errors.status_for` (logging anything unexpected with its traceback) and also answers
requests whose bytes did not parse (see `server.interceptors`) with INVALID_ARGUMENT.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NoReturn, TypeVar

import grpc

from .errors import InvalidRequest, status_for

logger = logging.getLogger(__name__)

Handler = TypeVar("Handler", bound=Callable[..., Any])


class Malformed:
    """Stands in for a request whose bytes did not parse."""

    __slots__ = ("error",)

    def __init__(self, error: Exception) -> None:
        self.error = error

    def invalid(self) -> InvalidRequest:
        return InvalidRequest(f"the request message could not be parsed: {self.error}")


async def abort_with(context: grpc.aio.ServicerContext, exc: Exception) -> NoReturn:
    """End the RPC with the status `exc` maps to (context.abort raises)."""
    code, message = status_for(exc)
    if code is grpc.StatusCode.INTERNAL:
        logger.error("RPC failed unexpectedly", exc_info=exc)
    await context.abort(code, message)
    raise AssertionError("unreachable: context.abort raises")


def handles_errors(handler: Handler) -> Handler:
    """Map what a unary or server-streaming handler raises to its gRPC status.

    `asyncio.CancelledError` (a BaseException) passes through untouched, and so does
    the AbortError of a handler that aborted the RPC itself.
    """
    if inspect.isasyncgenfunction(handler):

        @functools.wraps(handler)
        async def stream(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                if isinstance(request, Malformed):
                    raise request.invalid()
                messages: AsyncIterator[Any] = handler(self, request, context)
                async for message in messages:
                    yield message
            except grpc.aio.AbortError:
                raise
            except Exception as exc:
                await abort_with(context, exc)

        return stream  # type: ignore[return-value]

    unary_handler: Callable[..., Awaitable[Any]] = handler

    @functools.wraps(handler)
    async def unary(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            if isinstance(request, Malformed):
                raise request.invalid()
            return await unary_handler(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await abort_with(context, exc)

    return unary  # type: ignore[return-value]
