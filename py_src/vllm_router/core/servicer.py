"""What every contract's servicer shares: the serving core it is built on, and `handles_errors`.

`ServingCore` is the one set of shared parts on a server (engine, request table, serving
state, tokenizer files, metrics); each contract's servicer is a `ContractServicer` over
it. A decorated handler raises; `handles_errors` turns what it raised into the status
from `errors.status_for` (logging anything unexpected with its traceback), makes an
engine death NOT_SERVING everywhere before that status goes out, answers requests whose
bytes did not parse (see `server.interceptors`) with INVALID_ARGUMENT, and counts every
finished RPC by its status code.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, NoReturn, TypeVar

import grpc

from ..engine import AsyncEngine
from ..errors import EngineDead, EngineOperationFailed, InvalidRequest, status_code, status_for
from .flight import DirectSend, DirectStepRenderer, TransportSend
from .health import ServingState
from .lora_paths import LoraPathRule
from .metrics import ServicerMetrics
from .operations import EngineOperations
from .requests import RequestTable
from .tokenizer import TokenizerFiles
from .weight_updates import WeightUpdates

logger = logging.getLogger(__name__)

Handler = TypeVar("Handler", bound=Callable[..., Any])


@dataclass
class ServingCore:
    """The parts of one server that every contract shares."""

    engine: AsyncEngine
    requests: RequestTable
    state: ServingState
    metrics: ServicerMetrics | None = None
    # A stream context's transport send that never waits (None: the transport has none,
    # or direct sends are off); see core/flight.py.
    transport_send: Callable[[grpc.aio.ServicerContext], TransportSend | None] = lambda _: None
    # Where a LoRA adapter loaded at a remote caller's word may come from.
    lora_paths: LoraPathRule = field(default_factory=LoraPathRule)
    tokenizer: TokenizerFiles = field(init=False)
    # Pause, sleep, weight updates...: one at a time, measured and traced.
    operations: EngineOperations = field(init=False)
    # The weight-update sequence: out-of-order steps refused, a part-loaded model unserved.
    weight_updates: WeightUpdates = field(init=False)
    started: float = field(init=False, default_factory=time.monotonic)  # for uptimes

    def __post_init__(self) -> None:
        self.tokenizer = TokenizerFiles(self.engine)
        self.operations = EngineOperations(self.metrics)
        self.weight_updates = WeightUpdates(self.state)


class Malformed:
    """Stands in for a request whose bytes did not parse."""

    __slots__ = ("error",)

    def __init__(self, error: Exception) -> None:
        self.error = error

    def invalid(self) -> InvalidRequest:
        return InvalidRequest(f"the request message could not be parsed: {self.error}")


def _status(exc: Exception) -> tuple[grpc.StatusCode, str]:
    code, message = status_for(exc)
    if isinstance(exc, EngineOperationFailed):  # the engine's own refusal, not our bug
        logger.warning("%s", message)
    elif code is grpc.StatusCode.INTERNAL:
        logger.error("RPC failed unexpectedly", exc_info=exc)
    return code, message


async def failure_status(state: ServingState, exc: Exception) -> tuple[grpc.StatusCode, str]:
    """The status a failure is told with, after what every failure needs: an engine death
    turns the worker NOT_SERVING first; a bug (INTERNAL) is logged with its traceback."""
    if isinstance(exc, EngineDead):
        await state.engine_died(exc.message)
    return _status(exc)


async def abort_with(context: grpc.aio.ServicerContext, exc: Exception) -> NoReturn:
    """End the RPC with the status `exc` maps to (context.abort raises)."""
    await context.abort(*_status(exc))
    raise AssertionError("unreachable: context.abort raises")


class ContractServicer:
    """A contract's servicer: the serving core's parts, and where `handles_errors` counts
    finished RPCs (`service_label` names them)."""

    service_label: str
    # Every RPC of the service, by who calls it (server/security.py): `control_rpcs` change
    # the worker (or read its control state: adapters' paths, holds, the weight version) and
    # need the control key when one is set; `router_rpcs` are what a router sends (generation,
    # Abort, info, loads, tokenizer, KV events) and need only the API key. Each RPC is in
    # exactly one (a structure test holds it), so a new RPC is classified when it is added.
    control_rpcs: ClassVar[frozenset[str]] = frozenset()
    router_rpcs: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, core: ServingCore) -> None:
        self.core = core
        self._engine = core.engine
        self._requests = core.requests
        self._state = core.state

    def _direct_send(
        self, context: grpc.aio.ServicerContext, render: DirectStepRenderer
    ) -> DirectSend | None:
        """The stream's direct send, if its transport has one, with the contract's `render`
        for it (a stream handler passes it to `RequestTable.run`: its plain steps then skip
        the handler)."""
        send = self.core.transport_send(context)
        return DirectSend(send, render) if send is not None else None

    @functools.cached_property
    def _eos(self) -> frozenset[int]:
        """The model's EOS ids: what tells a request that stopped at EOS from one that
        stopped at a stop token id, in the contracts that report which."""
        return frozenset(self._engine.facts.eos_token_ids)


async def _failed(servicer: ContractServicer, context: Any, exc: Exception) -> NoReturn:
    await context.abort(*await failure_status(servicer._state, exc))
    raise AssertionError("unreachable: context.abort raises")


def _count(
    servicer: ContractServicer, method: str, code: grpc.StatusCode | None, context: Any
) -> None:
    metrics = servicer.core.metrics
    if metrics is None:
        return
    if code is None:  # left early: the client went away, or its deadline passed
        remaining = context.time_remaining()
        expired = remaining is not None and remaining <= 0
        code = grpc.StatusCode.DEADLINE_EXCEEDED if expired else grpc.StatusCode.CANCELLED
    metrics.requests.labels(servicer.service_label, method, code.name).inc()


class _Outcome:
    """How one RPC ended: None while it runs, and if it never ends in a status (the
    client went away, or its deadline passed)."""

    __slots__ = ("code",)

    def __init__(self) -> None:
        self.code: grpc.StatusCode | None = None


@contextlib.asynccontextmanager
async def _answered(
    servicer: ContractServicer, method: str, request: Any, context: grpc.aio.ServicerContext
) -> AsyncIterator[_Outcome]:
    """The one error mapping of `handles_errors`, around a unary or a streaming body:
    a Malformed request is INVALID_ARGUMENT, what the body raises ends the RPC with its
    status, and the finished RPC is counted by its code."""
    outcome = _Outcome()
    try:
        if isinstance(request, Malformed):
            raise request.invalid()
        yield outcome
        outcome.code = grpc.StatusCode.OK
    except grpc.aio.AbortError:
        outcome.code = _aborted_code(context)
        raise
    except Exception as exc:
        outcome.code = status_for(exc)[0]
        await _failed(servicer, context, exc)
    finally:
        _count(servicer, method, outcome.code, context)


# Set on every handler `handles_errors` wraps, so that a structure test can prove every RPC
# of every registered servicer wears it (the interceptors rely on it: they map nothing).
_MAPPED = "__vllm_servicer_errors_mapped__"


def errors_mapped(handler: object) -> bool:
    """Whether `handler` is wrapped by `handles_errors`."""
    return getattr(handler, _MAPPED, False) is True


def handles_errors(handler: Handler) -> Handler:
    """Map what a unary or server-streaming handler raises to its gRPC status, and
    count the finished RPC by method and status code (`vllm_servicer:requests_total`).

    `asyncio.CancelledError` (a BaseException) passes through untouched, and so does
    the AbortError of a handler that aborted the RPC itself.
    """
    method = handler.__name__
    if inspect.isasyncgenfunction(handler):

        @functools.wraps(handler)
        async def stream(
            self: ContractServicer, request: Any, context: grpc.aio.ServicerContext
        ) -> Any:
            async with _answered(self, method, request, context):
                messages: AsyncIterator[Any] = handler(self, request, context)
                async for message in messages:
                    yield message

        setattr(stream, _MAPPED, True)
        return stream  # type: ignore[return-value]

    unary_handler: Callable[..., Awaitable[Any]] = handler

    @functools.wraps(handler)
    async def unary(self: ContractServicer, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async with _answered(self, method, request, context):
            return await unary_handler(self, request, context)

    setattr(unary, _MAPPED, True)
    return unary  # type: ignore[return-value]


def _aborted_code(context: grpc.aio.ServicerContext) -> grpc.StatusCode:
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code
    return status_code(code)  # type: ignore[arg-type]
