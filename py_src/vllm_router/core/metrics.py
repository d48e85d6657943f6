"""The front end's Prometheus series (`vllm_servicer:*`), declared once, per server.

Each server owns a `CollectorRegistry` (tests run several servers in one process);
`exposition_registry` joins it with the engine's own registry (vLLM's `vllm:*`
series, exactly as vLLM's OpenAI server exposes them) for the `/metrics` endpoint.
Names are a contract: dashboards and alerts rely on them (docs/operations.md, examples/grafana).
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from ..errors import (
    DuplicateRequest,
    EngineUnavailable,
    InvalidRequest,
    NotConfigured,
    Overloaded,
    ServicerError,
)

PREFIX = "vllm_servicer:"

# Why admission refused a request, by the error it raised (the `cause` label).
REJECTION_CAUSES: dict[type[ServicerError], str] = {
    EngineUnavailable: "not_serving",
    Overloaded: "overloaded",
    DuplicateRequest: "duplicate_request_id",
    InvalidRequest: "invalid_prompt",
    NotConfigured: "wrong_model_kind",
}
UNAUTHENTICATED = "unauthenticated"

# Seconds; generation spans milliseconds (a short unary) to minutes (long outputs).
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
FIRST_MESSAGE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
# Seconds an engine operation holds the engine: a pause is milliseconds, a weight update
# of a large model tens of seconds to minutes.
OPERATION_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
BETWEEN_MESSAGES_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5,
)  # fmt: skip


class LoopCounter(Collector):
    """A counter without labels, counted from the event loop's thread alone.

    For the series a stream updates per token: prometheus_client's own take a lock per
    update, more than a tenth of what a token costs the whole native path
    (benchmarks/results/metrics-per-token.md). Here an update is a plain addition, safe
    because only the loop's thread writes; the scrape's
    thread reads under the GIL. Exposed exactly as `prometheus_client.Counter` would be.
    """

    def __init__(self, name: str, documentation: str, registry: CollectorRegistry) -> None:
        self._name, self._documentation = name, documentation
        self._created = time.time()
        self.value = 0
        registry.register(self)

    def inc(self, amount: int = 1) -> None:
        self.value += amount

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily(
            self._name, self._documentation, value=self.value, created=self._created
        )


class LoopHistogram(Collector):
    """A histogram without labels, observed from the event loop's thread alone (see
    `LoopCounter` for why): an observation is a bisection and two additions.
    Exposed exactly as `prometheus_client.Histogram` would be; its count is the sum of
    its buckets, so a scrape never sees them disagree."""

    def __init__(
        self,
        name: str,
        documentation: str,
        buckets: Sequence[float],
        registry: CollectorRegistry,
    ) -> None:
        self._name, self._documentation = name, documentation
        self._created = time.time()
        self._bounds = tuple(buckets)
        # A value lands in the first bucket whose bound it does not exceed (`le`); the
        # last slot is +Inf.
        self._counts = [0] * (len(self._bounds) + 1)
        self._sum = 0.0
        registry.register(self)

    def observe(self, value: float) -> None:
        self._counts[bisect_left(self._bounds, value)] += 1
        self._sum += value

    def collect(self) -> Iterator[Metric]:
        counts = list(self._counts)
        cumulative, buckets = 0, []
        for bound, count in zip((*self._bounds, float("inf")), counts, strict=True):
            cumulative += count
            buckets.append((floatToGoString(bound), float(cumulative)))
        family = HistogramMetricFamily(
            self._name, self._documentation, buckets=buckets, sum_value=self._sum
        )
        family.add_sample(self._name + "_created", {}, self._created)
        yield family


class ServicerMetrics:
    """Every `vllm_servicer:*` series of one server."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry

        def name(short: str) -> str:
            return PREFIX + short

        self.requests = Counter(
            name("requests"),
            "Finished RPCs by service, method and gRPC status code name",
            ["service", "method", "code"],
            registry=r,
        )
        self.in_flight = Gauge(
            name("requests_in_flight"), "Generation and embedding requests in flight", registry=r
        )
        # Updated per request or per token: LoopCounter / LoopHistogram (see there why).
        self.prompt_tokens = LoopCounter(
            name("prompt_tokens"), "Prompt tokens of admitted requests", registry=r
        )
        self.generated_tokens = LoopCounter(
            name("generated_tokens"), "Tokens generated (every sample)", registry=r
        )
        self.finish_reason = Counter(
            name("finish_reason"),
            "Finished samples by the engine's reason (stop, length, abort, repetition, error)",
            ["reason"],
            registry=r,
        )
        self.rejected = Counter(
            name("rejected"),
            "Requests refused before reaching the engine, by cause",
            ["cause"],
            registry=r,
        )
        self.request_duration = LoopHistogram(
            name("request_duration_seconds"),
            "Admission to the end of a generation request",
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.time_to_first_message = LoopHistogram(
            name("time_to_first_message_seconds"),
            "Admission to the first response message (the whole response for unary RPCs)",
            buckets=FIRST_MESSAGE_BUCKETS,
            registry=r,
        )
        self.time_between_messages = LoopHistogram(
            name("time_between_messages_seconds"),
            "Between consecutive messages of one stream",
            buckets=BETWEEN_MESSAGES_BUCKETS,
            registry=r,
        )
        self.draining = Gauge(name("draining"), "1 while the server drains", registry=r)
        self.engine_alive = Gauge(name("engine_alive"), "0 once the engine is dead", registry=r)
        self.engine_silent = Gauge(
            name("engine_silent_seconds"),
            "Seconds the engine has had requests without making a step (0 while idle); "
            "past --engine-stall-timeout-seconds the worker leaves rotation, past "
            "--engine-stall-exit-seconds it is failed",
            registry=r,
        )
        self.engine_stall_stage = Gauge(
            name("engine_stall_stage"),
            "The progress watchdog's stage: 0 progressing, 1 stalled and out of rotation "
            "(NOT_SERVING, streams in flight kept), 2 failed (streams failed, exiting)",
            registry=r,
        )
        self.engine_stalls = Counter(
            name("engine_stalls"),
            "Stall stages entered: out_of_rotation, then recovered or failed",
            ["stage"],
            registry=r,
        )
        self.engine_operation = Histogram(
            name("engine_operation_seconds"),
            "Operations on the engine's state (pause, resume, sleep, wake_up, each "
            "weight-transfer step, the weight version): time holding the engine, by "
            "operation and gRPC status code name",
            ["operation", "code"],
            buckets=OPERATION_BUCKETS,
            registry=r,
        )
        for stage in ("out_of_rotation", "recovered", "failed"):
            self.engine_stalls.labels(stage)
        for cause in (*REJECTION_CAUSES.values(), UNAUTHENTICATED):
            self.rejected.labels(cause)  # every cause exported from the start, at 0

    def watch(
        self,
        in_flight: Callable[[], int],
        draining: Callable[[], bool],
        engine_alive: Callable[[], bool],
        engine_silent: Callable[[], float],
        stall_stage: Callable[[], int],
    ) -> None:
        """Gauges read at scrape time from the server's own state."""
        self.in_flight.set_function(lambda: float(in_flight()))
        self.draining.set_function(lambda: float(draining()))
        self.engine_alive.set_function(lambda: float(engine_alive()))
        self.engine_silent.set_function(engine_silent)
        self.engine_stall_stage.set_function(lambda: float(stall_stage()))

    def unauthenticated(self) -> None:
        self.rejected.labels(UNAUTHENTICATED).inc()

    def reject(self, exc: ServicerError) -> None:
        cause = REJECTION_CAUSES.get(type(exc))
        if cause is not None:
            self.rejected.labels(cause).inc()


class _Forward(Collector):
    """Exposes another registry's series through a combined registry."""

    def __init__(self, source: Collector) -> None:
        self._source = source

    def collect(self) -> Iterable[Metric]:
        return self._source.collect()


def exposition_registry(ours: CollectorRegistry, engine: Collector | None) -> CollectorRegistry:
    """Our series and the engine's (vLLM's `vllm:*`, process and Python series) in one."""
    combined = CollectorRegistry(auto_describe=False)
    combined.register(_Forward(ours))
    if engine is not None:
        combined.register(_Forward(engine))
    return combined
