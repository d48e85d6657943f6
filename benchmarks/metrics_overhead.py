"""What the vllm_servicer:* metrics cost per stream message, measured in-process.

End-to-end runs on a 2-core machine move by tens of percent between identical runs, far
more than this cost; this times exactly the per-message work the metrics add (the
Flight bookkeeping of one engine step and one sent message) with and without them.
Prints microseconds per message for both and the difference.
"""

from __future__ import annotations

import asyncio
import time

from vllm_router.engine import EngineStep
from vllm_router.serving.metrics import ServicerMetrics
from vllm_router.serving.requests import Flight

MESSAGES = 200_000


async def per_message_us(metrics: ServicerMetrics | None) -> float:
    flight = Flight("r", metrics)
    step = EngineStep(token_ids=[7], text="", finished=False)
    started = time.perf_counter()
    for _ in range(MESSAGES):
        flight.step(step)
        flight.sending()
        flight.sent()
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
