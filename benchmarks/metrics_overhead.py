"""What the vllm_servicer:* metrics cost per stream message, measured in-process.

End-to-end runs on a 2-core machine move by tens of percent between identical runs, far
more than this cost; this times exactly the per-message work the metrics add, with and
without them, on both ways a stream's message is sent: the task's (the Flight
bookkeeping of one engine step and one sent message, `Flight.messages`) and the direct
send's (one plain step given direct to the flight's receiver, `Flight.receiver`).
Prints microseconds per message for both and the difference.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from vllm_router.core.flight import DirectSend, Flight
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


async def per_direct_step_us(metrics: ServicerMetrics | None) -> float:
    """One stream's plain steps given direct to its flight's receiver (a send that takes
    every message), after the first step went the task's way as it does in the engine."""
    flight = Flight("r", metrics, DirectSend(lambda message: True, lambda ids, last, count: ids))
    receiver = flight.receiver
    assert receiver is not None
    flight.begin(_steps())
    async for _ in flight.messages(lambda step: (step,)):
        break
    token_ids = [7]
    started = time.perf_counter()
    for count in range(MESSAGES):
        receiver(token_ids, count)
    return (time.perf_counter() - started) * 1e6 / MESSAGES


async def main() -> None:
    for label, measure in (("task's send", per_message_us), ("direct send", per_direct_step_us)):
        runs: dict[str, list[float]] = {"off": [], "on": []}
        for _ in range(5):
            runs["off"].append(await measure(None))
            runs["on"].append(await measure(ServicerMetrics()))
        off, on = min(runs["off"]), min(runs["on"])
        print(
            f"{label}: per message without metrics {off:.2f} µs, with {on:.2f} µs; "
            f"metrics add {on - off:.2f} µs (best of 5)"
        )


if __name__ == "__main__":
    asyncio.run(main())
