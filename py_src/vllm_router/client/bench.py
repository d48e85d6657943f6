"""`vllm-servicer-client bench`: N streams at concurrency C against one worker, measured.

The quick check after a deploy: does the worker answer, how fast, how evenly. Every
request streams token ids only (no detokenization), `ignore_eos`, fixed length.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from .errors import WorkerError
from .worker import WorkerClient


@dataclass
class Timing:
    start: float = 0.0
    first: float | None = None
    end: float = 0.0
    tokens: int = 0
    gaps: list[float] = field(default_factory=list)
    error: str | None = None


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


async def run(
    worker: WorkerClient,
    *,
    requests: int,
    concurrency: int,
    prompt_tokens: int,
    max_tokens: int,
    stream_interval: int = 1,
    batched: bool = False,
    progress: Any = None,
) -> dict[str, Any]:
    """Run the load; returns the summary (what `summary_rows` prints). `batched`: every
    request on one GenerateBatch stream instead of a GenerateStream each."""
    vocab = (await worker.model_info()).vocab_size
    extra: dict[str, Any] = {"stream_interval": stream_interval} if stream_interval > 1 else {}
    rng = random.Random(0)
    prompts = [[rng.randrange(1, vocab) for _ in range(prompt_tokens)] for _ in range(requests)]
    timings = [Timing() for _ in range(requests)]
    queue = iter(range(requests))
    batch = worker.batch() if batched else None

    async def one(i: int) -> None:
        timing = timings[i]
        timing.start = last = time.perf_counter()
        try:
            stream = (batch or worker).stream(
                prompts[i],
                skip_detokenize=True,
                max_tokens=max_tokens,
                ignore_eos=True,
                seed=i,
                **extra,
            )
            async for message in stream:
                now = time.perf_counter()
                if timing.first is None:
                    timing.first = now
                else:
                    timing.gaps.append((now - last) / max(len(message.token_ids), 1))
                last = now
                timing.tokens += len(message.token_ids)
        except WorkerError as exc:
            timing.error = f"{exc.code.name}: {exc.details}"
        timing.end = time.perf_counter()
        if progress is not None:
            progress.update(1)

    async def lane() -> None:
        for i in queue:
            await one(i)

    started = time.perf_counter()
    try:
        await asyncio.gather(*(lane() for _ in range(concurrency)))
    finally:
        if batch is not None:
            await batch.close()
    wall = time.perf_counter() - started
    done = [t for t in timings if t.error is None]
    tokens = sum(t.tokens for t in timings)
    ms = 1000.0
    ttft = [(t.first - t.start) * ms for t in done if t.first is not None]
    itl = [gap * ms for t in done for gap in t.gaps]
    latency = [(t.end - t.start) * ms for t in done]
    errors = sorted({t.error for t in timings if t.error})
    return {
        "requests": requests,
        "concurrency": concurrency,
        "succeeded": len(done),
        "failed": requests - len(done),
        "wall_s": wall,
        "output_tokens": tokens,
        "tokens_per_s": tokens / wall if wall else 0.0,
        "requests_per_s": len(done) / wall if wall else 0.0,
        "ttft_ms": {"p50": _percentile(ttft, 50), "p99": _percentile(ttft, 99)},
        "itl_ms": {"p50": _percentile(itl, 50), "p99": _percentile(itl, 99)},
        "latency_ms": {
            "p50": _percentile(latency, 50),
            "p99": _percentile(latency, 99),
            "mean": statistics.fmean(latency) if latency else None,
        },
        "errors": errors[:5],
    }


def summary_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f} ms"

    rows = [
        ("requests", f"{summary['succeeded']} ok, {summary['failed']} failed "
                     f"(concurrency {summary['concurrency']})"),
        ("wall time", f"{summary['wall_s']:.2f} s"),
        ("throughput", f"{summary['tokens_per_s']:.1f} tokens/s, "
                       f"{summary['requests_per_s']:.2f} requests/s"),
        ("TTFT p50 / p99", f"{ms(summary['ttft_ms']['p50'])} / {ms(summary['ttft_ms']['p99'])}"),
        ("ITL p50 / p99", f"{ms(summary['itl_ms']['p50'])} / {ms(summary['itl_ms']['p99'])}"),
        ("latency p50 / p99",
         f"{ms(summary['latency_ms']['p50'])} / {ms(summary['latency_ms']['p99'])}"),
    ]  # fmt: skip
    rows += [("error", error) for error in summary["errors"]]
    return rows
