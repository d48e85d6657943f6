"""The benchmark workload and its statistics, shared by every target's client."""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Workload:
    requests: int
    concurrency: int
    prompt_len: int = 32
    output_len: int = 64
    sampled: bool = False
    skip_detokenize: bool = False
    vocab: int = 500
    # Ask for a message every this many tokens (ours: SamplingParams.stream_interval).
    stream_interval: int = 1

    def prompts(self) -> list[list[int]]:
        rng = random.Random(1234)
        return [
            [rng.randrange(3, self.vocab) for _ in range(self.prompt_len)]
            for _ in range(self.requests)
        ]

    @property
    def temperature(self) -> float:
        return 0.8 if self.sampled else 0.0


@dataclass
class Record:
    """One request as the client saw it."""

    start: float
    message_times: list[float] = field(default_factory=list)
    message_tokens: list[int] = field(default_factory=list)
    error: str | None = None
    # The first message of any kind (the native contract's first is prompt_info, no token).
    first_message_at: float | None = None

    def message(self, n_tokens: int) -> None:
        if self.first_message_at is None:
            self.first_message_at = time.perf_counter()
        if n_tokens:
            self.message_times.append(time.perf_counter())
            self.message_tokens.append(n_tokens)


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def summarize(target: str, workload: Workload, records: list[Record], wall: float) -> dict:
    ok = [r for r in records if r.error is None]
    tokens = sum(sum(r.message_tokens) for r in ok)
    ttft = [(r.message_times[0] - r.start) * 1000 for r in ok if r.message_times]
    itl = []
    for r in ok:
        for prev, now, n in zip(
            r.message_times, r.message_times[1:], r.message_tokens[1:], strict=False
        ):
            itl.extend([(now - prev) * 1000 / n] * n)
    return {
        "target": target,
        "concurrency": workload.concurrency,
        "requests": workload.requests,
        "sampled": workload.sampled,
        "skip_detokenize": workload.skip_detokenize,
        "tokens_per_s": tokens / wall,
        "requests_per_s": len(ok) / wall,
        "ttft_p50_ms": _pct(ttft, 50),
        "ttft_p90_ms": _pct(ttft, 90),
        "ttft_p99_ms": _pct(ttft, 99),
        "itl_p50_ms": _pct(itl, 50),
        "itl_p99_ms": _pct(itl, 99),
        "messages_per_request": statistics.mean(len(r.message_times) for r in ok) if ok else 0,
        "tokens_per_request": tokens / len(ok) if ok else 0,
        "output_len": workload.output_len,
        "errors": len(records) - len(ok),
        "first_error": next((r.error for r in records if r.error), None),
    }


def add_cpu(result: dict, front_end_seconds: float, rss: float) -> None:
    """Front-end CPU microseconds per generated token, and the server's resident memory."""
    tokens = result["tokens_per_request"] * (result["requests"] - result["errors"])
    result["cpu_us_per_token"] = front_end_seconds * 1e6 / tokens if tokens else float("nan")
    result["rss_mb"] = rss
