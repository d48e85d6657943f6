"""The load board: the scheduler's latest figures per data-parallel rank, fed by vLLM.

A vLLM stat logger (`StatLoggerBase`) records every engine step; the board keeps
each rank's latest figures and when they arrived, so loads are right while idle too.
Where this vLLM's stat logger or SchedulerStats do not match what the board reads
(compat.LOAD_FIGURES), the adapter calls `unmeasured()`: every rank's figures stay
unknown, never a 0 that reads as an idle rank.
"""

from __future__ import annotations

import bisect
import functools
import time
from typing import Any

from prometheus_client.registry import Collector

from ..types import LoadSnapshot, RankLoad


class LoadBoard:
    def __init__(self, dp_size: int = 1) -> None:
        # Unknown until each rank's engine core reports (its initialization counts: an
        # engine core that has just started is truly idle).
        self._ranks = {rank: RankLoad(rank, 0, 0, 0.0, None) for rank in range(dp_size)}
        self.snapshot = LoadSnapshot()
        self._measured = True
        # Monotonic time of the engine's latest step (any rank), or of work arriving at an
        # idle engine: the progress watchdog's clock (EngineProgress.last_step).
        self.last_step = time.monotonic()

    def stepped(self) -> None:
        self.last_step = time.monotonic()

    def unmeasured(self) -> None:
        """Publish no figures from now on: each rank's stay unknown as before its first
        report (GetLoads leaves its time unset or the rank out; WorkerMetrics read 0)."""
        self._measured = False
        self._ranks = {rank: RankLoad(rank, 0, 0, 0.0, None) for rank in self._ranks}
        self.snapshot = LoadSnapshot()

    def update(self, engine_index: int, running: int, waiting: int, kv_usage: float) -> None:
        if not self._measured:
            return
        self._ranks[engine_index] = RankLoad(engine_index, running, waiting, kv_usage, time.time())
        ranks = self._ranks.values()
        # A new object per step: readers cache what they build from it by identity.
        self.snapshot = LoadSnapshot(
            running_requests=sum(r.running_requests for r in ranks),
            waiting_requests=sum(r.waiting_requests for r in ranks),
            kv_cache_usage=max(r.kv_cache_usage for r in ranks),
        )

    def ranks(self) -> list[RankLoad]:
        return [self._ranks[rank] for rank in sorted(self._ranks)]

    def stat_logger_factory(self) -> Any:
        from vllm.v1.metrics.loggers import StatLoggerBase

        board = self

        class LoadStatLogger(StatLoggerBase):
            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                self.engine_index = engine_index

            def record(
                self,
                scheduler_stats: Any,
                iteration_stats: Any,
                mm_cache_stats: Any = None,
                engine_idx: int | None = None,
                **more: Any,
            ) -> None:
                board.stepped()
                # Read by name with defaults, so a renamed field costs a figure, not the
                # engine's output loop (compat.py checks and logs the names at start).
                if scheduler_stats is not None:
                    figure = functools.partial(getattr, scheduler_stats)
                    board.update(
                        self.engine_index if engine_idx is None else engine_idx,
                        figure("num_running_reqs", 0),
                        figure("num_waiting_reqs", 0) + figure("num_skipped_waiting_reqs", 0),
                        figure("kv_cache_usage", 0.0),
                    )

            def log_engine_initialized(self) -> None:
                board.update(self.engine_index, 0, 0, 0.0)

        return LoadStatLogger


def capture_engine_registry(own_copy: bool = True) -> Collector:
    """The Prometheus series of the engine just created, bound to it.

    vLLM registers its `vllm:*` series in prometheus_client's default registry (or a
    multiprocess one) and unregisters the previous engine's when another engine is
    created in the process; a registry of the collectors present now keeps this
    engine's series. Read the way vLLM's own `unregister_vllm_metrics` reads them
    (`own_copy`; without it, the process-wide registry is forwarded as it is).
    """
    from prometheus_client import REGISTRY, CollectorRegistry
    from vllm.v1.metrics.prometheus import get_prometheus_registry

    source = get_prometheus_registry()
    if source is not REGISTRY or not own_copy:
        return source
    own = CollectorRegistry(auto_describe=False)
    for collector in list(REGISTRY._collector_to_names):
        own.register(collector)
    return own


# The attribute on vLLM's IterationStats where the fast loop leaves a step's inter-token
# latencies, counted by value, for `BulkLatencies` to observe after vLLM's logger.
BULK_LATENCIES = "bulk_inter_token_latencies"


class BulkLatencies:
    """`vllm:inter_token_latency_seconds` observed once per distinct value per step.

    vLLM's Prometheus logger observes every inter-token latency of a step one call at a
    time (a lock, a bucket scan, per token: docs/benchmarks.md). In a decode step almost
    every request's latency is the same value (the time since the previous step), so the
    fast loop counts them by value (`BULK_LATENCIES` on the step's IterationStats) and this
    adds each value with its count to the same histogram child, after vLLM's `record` for
    that step: the same buckets, count and sum (up to float rounding) as one observation
    each.
    Only vLLM's Prometheus logger reads these latencies (compat.py checks the loggers).
    """

    def __init__(self, prometheus_logger: Any) -> None:
        self._histograms = prometheus_logger.histogram_inter_token_latency
        record = prometheus_logger.record
        if getattr(record, BULK_LATENCIES, False):
            return  # another adapter over the same AsyncLLM wrapped it already: once only

        def record_then_bulk(
            scheduler_stats: Any,
            iteration_stats: Any,
            mm_cache_stats: Any = None,
            engine_idx: int = 0,
            **more: Any,
        ) -> None:
            record(
                scheduler_stats,
                iteration_stats,
                mm_cache_stats=mm_cache_stats,
                engine_idx=engine_idx,
                **more,
            )
            counts = getattr(iteration_stats, BULK_LATENCIES, None)
            if counts:
                observe_counts(self._histograms[engine_idx], counts)

        setattr(record_then_bulk, BULK_LATENCIES, True)
        prometheus_logger.record = record_then_bulk


def observe_counts(histogram: Any, counts: dict[float, int]) -> None:
    """`histogram.observe(value)` `count` times for each value, in one update per value
    (prometheus_client's Histogram keeps per-bucket counts and a sum; compat.py checks)."""
    bounds = histogram._upper_bounds
    buckets = histogram._buckets
    for value, count in counts.items():
        histogram._sum.inc(value * count)
        buckets[bisect.bisect_left(bounds, value)].inc(count)
