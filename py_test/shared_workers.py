"""The session-shared worker (`real`) and the routers in front of it are left as found.

Every test that uses them gets them SERVING, idle, neither paused nor asleep nor draining,
and registered and healthy in their routers; a test that leaves them otherwise fails in its
own teardown, and a router that has lost its worker anyway (the session's loop stood still
long enough for its health probes to miss: loop_watch.py) fails the test it is handed to,
naming where the loop stood still, instead of that test reading HTTP 503 with no cause.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request

import pytest

from harness import Harness, real_engine_idle
from loop_watch import LOOP_WATCH

# A test may end with the engine finishing its last aborted steps: how long that may take.
SETTLE_SECONDS = 15.0


async def what_is_left(harness: Harness) -> list[str]:
    """How the shared worker differs from SERVING, idle, unpaused, awake and not draining."""
    problems = []
    status = await harness.server.state.status()
    if not status.serving:
        problems.append(f"NOT_SERVING ({status.reason})")
    if harness.server.state.draining:
        problems.append("draining")
    if await harness.engine.is_paused():
        problems.append("paused (PauseGeneration without ResumeGeneration)")
    if await harness.engine.is_sleeping():
        problems.append("asleep (Sleep without WakeUp)")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + SETTLE_SECONDS
    while not (idle := real_engine_idle(harness) and not harness.server.requests.in_flight):
        if loop.time() > deadline:
            break
        await asyncio.sleep(0.05)
    if not idle:
        load = harness.engine.load()
        problems.append(
            f"busy {SETTLE_SECONDS:.0f} s after the test: {len(harness.server.requests.in_flight)}"
            f" requests in flight, {load.running_requests} running, "
            f"{load.waiting_requests} waiting in the engine"
        )
    return problems


def workers_seen(base: str) -> dict[str, bool]:
    """The router's own view of its workers: URL -> healthy (GET /workers, which SMG and
    vllm-router both serve)."""
    with urllib.request.urlopen(base + "/workers", timeout=5) as response:
        listed = json.loads(response.read())["workers"]
    return {worker["url"]: bool(worker["is_healthy"]) for worker in listed}


async def check_in_rotation(router: str, base: str, worker: Harness) -> None:
    """Fail unless `router` (at `base`) has `worker` registered and healthy, naming the
    stand-stills of the session's loop that could have cost it its health probes."""
    seen = await asyncio.to_thread(workers_seen, base)
    url = f"grpc://{worker.address}"
    if seen.get(url) is True:
        return
    standstills = [str(s) for s in LOOP_WATCH.standstills] or ["none"]
    state = await what_is_left(worker)
    pytest.fail(
        f"the shared router {router} ({base}) does not route to its worker {url}: it sees "
        f"{seen}. The worker itself is {', '.join(state) or 'SERVING and idle'}. Where the "
        "session's event loop (which serves the in-process worker) stood still:\n  "
        + "\n  ".join(standstills)
    )
