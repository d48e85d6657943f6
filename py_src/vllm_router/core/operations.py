"""Operations on the engine's state, as an RL trainer drives them: one at a time, measured, traced.

Pause, resume, sleep, wake-up, each weight-transfer step and a weight-version change act
on the one engine every request shares, so they run in arrival order, never two at once
(vllm-rs serializes them the same way): a second `UpdateWeights` waits for the first. A
request's checks run before it queues, so a bad call is refused at once, not after the
calls ahead of it. "One at a time" holds whatever the callers do: an operation whose caller
leaves (its deadline passes) runs on to the end of the engine's call, and only then does
the next one start.

Each operation is observed in `vllm_servicer:engine_operation_seconds{operation,code}`
(the time it held the engine, by how it ended) and traced as one span, a child of the
caller's span when the call metadata carries a W3C `traceparent`: a trainer's trace of a
weight push shows each step on each worker. Spans go to the process's OpenTelemetry tracer
provider, the one vLLM sets up for `--otlp-traces-endpoint` (no endpoint: no-op spans).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from ..errors import status_for
from .metrics import ServicerMetrics

T = TypeVar("T")
TRACER_NAME = "vllm_servicer"
SPAN_PREFIX = "vllm_servicer.engine."


class EngineOperations:
    """The queue that state-changing engine operations pass through (see the module doc)."""

    def __init__(self, metrics: ServicerMetrics | None, tracer: Tracer | None = None) -> None:
        self._metrics = metrics
        # The global provider's tracer resolves lazily: vLLM installs its provider when
        # the engine starts, which may be after this server is built.
        self._tracer = tracer or trace.get_tracer(TRACER_NAME)
        self._lock = asyncio.Lock()

    @property
    def busy(self) -> bool:
        """Whether an operation runs now."""
        return self._lock.locked()

    async def run(
        self,
        operation: str,
        trace_context: Mapping[str, str] | None,
        attributes: Mapping[str, str | int | bool] | None,
        work: Callable[[], Awaitable[T]],
    ) -> T:
        """Run `work` (e.g. "update_weights") holding the engine, once the operations ahead
        of it are done. A caller that leaves while queued runs nothing. One that leaves once
        `work` has started does not stop it: the engine's call runs to its end, the next
        operation waits for that end, and the span and the metric say how it ended."""
        parent = TraceContextTextMapPropagator().extract(trace_context) if trace_context else None
        span = self._tracer.start_span(
            SPAN_PREFIX + operation,
            context=parent,
            kind=SpanKind.SERVER,
            attributes={f"vllm_servicer.{key}": value for key, value in (attributes or {}).items()},
        )
        queued = time.perf_counter()
        try:
            await self._lock.acquire()
        except asyncio.CancelledError:
            self._ended(span, operation, "CANCELLED", 0.0)
            raise
        span.set_attribute("vllm_servicer.queued_seconds", time.perf_counter() - queued)
        held = asyncio.ensure_future(self._held(operation, span, work))
        held.add_done_callback(_retrieved)  # a caller that left does not read it
        return await asyncio.shield(held)

    async def _held(self, operation: str, span: Span, work: Callable[[], Awaitable[T]]) -> T:
        started = time.perf_counter()
        code = "CANCELLED"  # the server stopped under it
        try:
            result = await work()
            code = "OK"
            return result
        except Exception as exc:
            status, message = status_for(exc)
            code = status.name
            span.set_status(Status(StatusCode.ERROR, f"{code}: {message}"))
            raise
        finally:
            self._lock.release()
            self._ended(span, operation, code, time.perf_counter() - started)

    def _ended(self, span: Span, operation: str, code: str, elapsed: float) -> None:
        span.set_attribute("vllm_servicer.status", code)
        span.end()
        if self._metrics is not None:
            self._metrics.engine_operation.labels(operation, code).observe(elapsed)


def _retrieved(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()
