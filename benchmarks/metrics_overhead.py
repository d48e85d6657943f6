"""What the vllm_servicer:* metrics cost per stream message, measured in-process.

End-to-end runs on a 2-core machine move by tens of percent between identical runs, far
more than this cost; this times exactly the per-message work the metrics add (the
Flight bookkeeping of one engine step and one sent message, `Flight.messages`) with
and without them.
Prints microseconds per message for both and the difference.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from vllm_router.core.flight import Flight
from vllm_router.core.metrics import ServicerMetrics
from vllm_router.engine import EngineStep

MESSAGES = 200_000


async def _steps() -> AsyncIterator[EngineStep]:
    step = EngineStep(token_ids=[7], text="", finished=False)
    for _ in range(MESSAGES):
        yield step


async def per_message_us(metrics: ServicerMetrics | None) -> float:
    """One stream's messages through Flight.messages (its step and send accounting)."""
    flight = Flight("r", metrics)
    flight.begin(_steps())
    started = time.perf_counter()
    async for _ in flight.messages(lambda step: (step,)):
        pass
    return (time.perf_counter() - started) * 1e6 / MESSAGES


async def main() -> None:
    runs = {"off": [], "on": []}
    for _ in range(5):
        runs["off"].append(await per_message_us(None))
        runs["on"].append(await per_message_us(ServicerMetrics()))
    off, on = min(runs["off"]), min(runs["on"])
    print(f"per message without metrics: {off:.2f} µs")
    print(f"per message with metrics:    {on:.2f} µs")
    print(f"metrics add:                 {on - off:.2f} µs per message (best of 5)")


if __name__ == "__main__":
    asyncio.run(main())
