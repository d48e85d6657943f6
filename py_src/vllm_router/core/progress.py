"""The engine progress watchdog: an engine that has work and makes no step for too long is stuck.

A dead engine announces itself (vLLM's output loop fails, `errored` turns true); a stuck one
does not: a wedged GPU step or collective, or an engine-core process stopped from outside,
leaves a live process that answers nothing. Without this watchdog such a worker reports
SERVING forever while every request hangs until its own deadline, and a router keeps
sending it traffic. The watchdog reads `AsyncEngine.progress()` (never a call into the
engine, which would hang too): while the engine has work it does not hold on purpose
(paused, asleep), a silence longer than the timeout is treated exactly as engine death —
NOT_SERVING on every service name, every request in flight ends UNAVAILABLE with a message
that says why, new requests are refused, and the server exits non-zero so its supervisor
restarts the worker. An idle engine is never judged, and a slow step that ends before the
timeout is only slow. With data parallelism a step of any rank counts (vLLM's scheduler
stats do not say which requests a rank holds): a collective that wedges stops every rank,
but one rank stuck while another steps is not found here.
"""

from __future__ import annotations

import asyncio
import logging
import time

from ..engine import AsyncEngine
from ..errors import EngineUnavailable
from .health import ServingState
from .requests import RequestTable

logger = logging.getLogger(__name__)

# A long prefill is chunked into steps (vLLM's default scheduler), so even a huge prompt on
# a large model on a GPU makes a step every second or two; vLLM's own executor gives up on
# one model step only after VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS (300). Two minutes finds a
# wedged worker well before that, with room for a slow first step (lazy compilation).
DEFAULT_TIMEOUT_SECONDS = 120.0


def stuck_message(seconds: float) -> str:
    return (
        f"the engine stopped making progress: no engine step for {seconds:.0f}s while "
        "requests were running; this worker is restarting (retry on another worker)"
    )


def silent_for(engine: AsyncEngine, now: float | None = None) -> float:
    """Seconds the engine has had work without making a step (0 when idle or held)."""
    progress = engine.progress()
    if not progress.busy or progress.last_step is None:
        return 0.0
    return max(0.0, (time.monotonic() if now is None else now) - progress.last_step)


async def watch_engine_progress(
    engine: AsyncEngine, state: ServingState, requests: RequestTable, timeout: float
) -> None:
    """Run until the engine is found stuck (then handle it and return) or cancelled."""
    if engine.progress().last_step is None:
        logger.warning(
            "This engine does not report its steps: no progress watchdog (a stuck engine "
            "is found only when it dies)"
        )
        return
    while not state.engine_dead:
        await asyncio.sleep(min(1.0, timeout / 4))
        silent = silent_for(engine)
        if silent <= timeout:
            continue
        message = stuck_message(silent)
        logger.error(
            "Engine stuck: no step for %.1fs with %d request(s) in flight (--engine-stall-"
            "timeout-seconds %.1f); reporting NOT_SERVING and failing them",
            silent,
            len(requests.in_flight),
            timeout,
        )
        await state.engine_died(f"no engine step for {silent:.1f}s", reason=message)
        requests.fail_all(EngineUnavailable(message))
        return
