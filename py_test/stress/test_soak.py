"""Many streams, cancel storms and long runs against the mock engine, in-process."""

from __future__ import annotations

import asyncio
import gc
import random
import time
from pathlib import Path

import grpc

from .conftest import scale
from harness import StartServer, request, wait_until

RSS_LIMIT_MB = 20


async def test_concurrent_streams_all_complete_with_every_token(
    start_mock: StartServer, figures
) -> None:
    n, tokens = scale(1000, 1000), 32
    harness = await start_mock(step_delay=0.002, max_num_seqs=4096)

    async def one(i: int) -> list[int]:
        last = 100 + (i % 1000)
        call = harness.stub.GenerateStream(request([last], max_tokens=tokens))
        return [t async for m in call for t in m.token_ids]

    started = time.perf_counter()
    results = await asyncio.gather(*(one(i) for i in range(n)), return_exceptions=True)
    elapsed = time.perf_counter() - started
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors[:3]
    for i, tokens_seen in enumerate(results):
        first = 101 + (i % 1000)
        assert tokens_seen == list(range(first, first + tokens)), i
    figures(
        f"{n} concurrent streams x {tokens} tokens: 0 errors, {n * tokens} tokens accounted for, "
        f"{elapsed:.2f}s ({n * tokens / elapsed:,.0f} tokens/s)"
    )


async def test_cancel_and_deadline_storm_leaves_nothing_behind(
    start_mock: StartServer, figures
) -> None:
    n = scale(1000, 10_000)
    harness = await start_mock(step_delay=0.002, max_num_seqs=4096)
    rng = random.Random(7)
    outcomes: dict[str, int] = {}

    async def one(i: int) -> None:
        kind = rng.choice(["before-first", "mid-stream", "last-token", "deadline", "complete"])
        max_tokens = 20
        if kind == "deadline":
            try:
                await harness.stub.Generate(request([10], max_tokens=max_tokens), timeout=0.01)
            except grpc.aio.AioRpcError as err:
                kind = f"deadline:{err.code().name}"
        else:
            call = harness.stub.GenerateStream(request([10], max_tokens=max_tokens))
            reads = {"before-first": 0, "mid-stream": rng.randint(1, 18), "last-token": 19}
            for _ in range(reads.get(kind, max_tokens)):
                await call.read()
            if kind == "complete":
                assert (await call.read()) is grpc.aio.EOF
            else:
                call.cancel()
        outcomes[kind] = outcomes.get(kind, 0) + 1

    started = time.perf_counter()
    for batch in range(0, n, 250):
        await asyncio.gather(*(one(i) for i in range(batch, min(n, batch + 250))))
    elapsed = time.perf_counter() - started
    await wait_until(
        lambda: (
            not harness.server.requests.in_flight and not harness.engine.load().running_requests
        ),
        10,
        "no request left behind",
    )
    load = harness.engine.load()
    assert (load.running_requests, load.waiting_requests) == (0, 0)
    assert harness.server.requests.in_flight == frozenset()
    figures(
        f"{n} requests in {elapsed:.1f}s, outcomes {dict(sorted(outcomes.items()))}; after: engine "
        f"running 0, waiting 0, servicer table empty"
    )


def _rss_mb() -> float:
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * 4096 / 2**20


async def test_many_short_requests_do_not_leak(start_mock: StartServer, figures) -> None:
    n, warmup, concurrency = scale(10_000, 100_000), 2_000, 50
    harness = await start_mock(max_num_seqs=4096)
    gate = asyncio.Semaphore(concurrency)

    async def one() -> None:
        async with gate:
            response = await harness.stub.Generate(request([10, 11], max_tokens=2))
            assert list(response.output_token_ids) == [12, 13]

    await asyncio.gather(*(one() for _ in range(warmup)))
    gc.collect()
    tasks_before = len(asyncio.all_tasks())
    base = _rss_mb()
    curve = []
    chunk = n // 10
    started = time.perf_counter()
    for _ in range(10):
        await asyncio.gather(*(one() for _ in range(chunk)))
        gc.collect()
        curve.append(round(_rss_mb() - base, 1))
    elapsed = time.perf_counter() - started
    tasks_after = len(asyncio.all_tasks())
    figures(
        f"{n} short requests after {warmup} warm-up in {elapsed:.1f}s ({n / elapsed:,.0f} req/s); "
        f"RSS growth MB per tenth: {curve}; asyncio tasks {tasks_before} -> {tasks_after}"
    )
    assert max(curve) < RSS_LIMIT_MB
    assert tasks_after <= tasks_before
