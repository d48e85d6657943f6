"""Operations on the engine's state, as an RL trainer drives them: one at a time, measured, traced.

Pause, resume, sleep, wake-up, each weight-transfer step and a weight-version change act
on the one engine every request shares, so they run in arrival order, never two at once
(vllm-rs serializes them the same way): a second `UpdateWeights` waits for the first. A
request's checks run before it queues, so a bad call is refused at once, not after the
calls ahead of it.

Each operation is observed in `vllm_servicer:engine_operation_seconds{operation,code}`
(the time it held the engine, by how it ended) and traced as one span, a child of the
caller's span when the call metadata carries a W3C `traceparent`: a trainer's trace of a
weight push shows each step on each worker. Spans go to the process's OpenTelemetry tracer
provider, the one vLLM sets up for `--otlp-traces-endpoint` (no endpoint: no-op spans).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Mapping

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from ..errors import status_for
from .metrics import ServicerMetrics

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

    @contextlib.asynccontextmanager
    async def run(
        self,
        operation: str,
        trace_context: Mapping[str, str] | None,
        attributes: Mapping[str, str | int | bool] | None = None,
    ) -> AsyncIterator[None]:
        """Hold the engine for `operation` (e.g. "update_weights") while the body runs."""
        parent = TraceContextTextMapPropagator().extract(trace_context) if trace_context else None
        with self._tracer.start_as_current_span(
            SPAN_PREFIX + operation,
            context=parent,
            kind=SpanKind.SERVER,
            attributes={f"vllm_servicer.{key}": value for key, value in (attributes or {}).items()},
            record_exception=False,
            set_status_on_exception=False,
        ) as span:
            queued = time.perf_counter()
            async with self._lock:
                started = time.perf_counter()
                span.set_attribute("vllm_servicer.queued_seconds", started - queued)
                code = "CANCELLED"  # the caller left (its deadline passed, or it went away)
                try:
                    yield
                    code = "OK"
                except Exception as exc:
                    status, message = status_for(exc)
                    code = status.name
                    span.set_status(Status(StatusCode.ERROR, f"{code}: {message}"))
                    raise
                finally:
                    span.set_attribute("vllm_servicer.status", code)
                    if self._metrics is not None:
                        elapsed = time.perf_counter() - started
                        self._metrics.engine_operation.labels(operation, code).observe(elapsed)
