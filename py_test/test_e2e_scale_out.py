"""Scale-out as users grow: one router (cache-aware) in front of two of our workers."""

from __future__ import annotations

import asyncio
import signal

import pytest

import servers
from harness import require
from real_engine import BASE_FLAGS, cli_flags, kv_events_config, require_vllm, tiny_model
from routers import openai_post, smg_path, smg_router_in_thread
from vllm_servers import free_port

pytestmark = pytest.mark.vllm
CHAT = "/v1/chat/completions"


def _handled(worker: servers.ServerProcess) -> int:
    """Generation requests this worker admitted (its request log, one line each)."""
    return sum("prompt tokens, n=" in line for line in worker.log)


async def _gained(workers: list, before: list[int], expected: int) -> list[int]:
    """Requests each worker admitted since `before`, once all `expected` are logged.

    The router answers before the worker's log line has necessarily been read
    from its pipe, so the count is awaited, not sampled (bounded: 10 s).
    """
    for _ in range(100):
        gained = [_handled(w) - b for w, b in zip(workers, before, strict=True)]
        if sum(gained) >= expected:
            break
        await asyncio.sleep(0.1)
    return gained


async def _chat(base: str, model: str, content: str) -> tuple[int, dict]:
    body = {"model": model, "messages": [{"role": "user", "content": content}],
            "max_tokens": 4, "temperature": 0}  # fmt: skip
    return await asyncio.to_thread(openai_post, base, CHAT, body)


async def test_two_workers_cache_aware_routing_and_failover(figures) -> None:
    require_vllm()
    require(smg_path() is not None, "smg is not installed (make test)")
    model = tiny_model()
    flags = [cli_flags({**BASE_FLAGS, **kv_events_config(free_port())}) for _ in range(2)]
    extra = ["--enable-log-requests", "--shutdown-grace-seconds", "20"]
    workers = await servers.start_together(
        *(servers.start("--model", str(model), "--port", "0", *f, *extra, timeout=300)
          for f in flags)
    )  # fmt: skip
    try:
        async with smg_router_in_thread(
            [w.address for w in workers], model, model.parent / "router-two.log",
            "--policy", "cache_aware", "--health-check-interval-secs", "1",
            "--health-failure-threshold", "1",
        ) as base:  # fmt: skip
            await _scenario(base, str(model), workers, figures)
    finally:
        await servers.stop_together(workers)


async def _scenario(base: str, model: str, workers: list, figures) -> None:
    # 1. Different prompts: traffic reaches both workers.
    prompts = [f"Topic {i} " * (i % 5 + 1) for i in range(24)]
    answers = await asyncio.gather(*(_chat(base, model, p) for p in prompts))
    assert all(status == 200 for status, _ in answers)
    spread = await _gained(workers, [0, 0], 24)
    assert min(spread) > 0, spread

    # 2. A long shared prefix: every follow-up lands where the prefix is cached.
    # Longer than one KV block (128 tokens on CPU), within the 256-token context.
    prefix = "The worker runs an engine that schedules many requests at once. " * 11
    before = [_handled(w) for w in workers]
    status, first = await _chat(base, model, prefix + "First.")
    assert status == 200 and first["usage"]["prompt_tokens"] > 128
    await asyncio.sleep(1.0)  # KV events reach the router
    cached = []
    for i in range(6):
        status, answer = await _chat(base, model, prefix + f"Follow-up {i}.")
        assert status == 200
        cached.append(answer["usage"]["prompt_tokens_details"]["cached_tokens"])
    gained = await _gained(workers, before, 7)
    assert sorted(gained) == [0, 7], gained
    assert min(cached) > 0, cached

    # 3. SIGTERM one worker: traffic moves to the other, nothing fails.
    holder = gained.index(7)
    workers[holder].process.send_signal(signal.SIGTERM)
    results = []
    for i in range(20):
        results.append((await _chat(base, model, prefix + f"After {i}."))[0])
        await asyncio.sleep(0.1)
    failed = sum(status != 200 for status in results)
    assert await workers[holder].wait(60) == 0
    figures(
        f"two workers: {spread} of 24 requests each; shared prefix: 7/7 on one worker, "
        f"cached_tokens {cached}; after SIGTERM: {failed} of 20 failed"
    )
    assert failed == 0, results
