"""The engine progress watchdog: an engine that has work and makes no step is stalled (two stages).

A dead engine announces itself (vLLM's output loop fails, `errored` turns true); a stuck one
does not: a wedged GPU step or collective, or an engine-core process stopped from outside,
leaves a live process that answers nothing. Without this watchdog such a worker reports
SERVING forever while every request hangs until its own deadline, and a router keeps sending
it traffic. But a long silence is not always a wedge: one prefill chunk of a large model on
vLLM-CPU, a first LoRA load from slow storage, a compile for a new shape or a swap storm stop
the steps for minutes and then the engine goes on. So the watchdog acts in two stages:

1. Out of rotation, at `--engine-stall-timeout-seconds` without a step while the engine has
   work: NOT_SERVING on every health name, new generation refused UNAVAILABLE with the reason,
   the streams in flight kept waiting. Cheap and undone by itself: at the engine's next step
   (or, once its requests have all gone, its next answer to a question) the worker is SERVING
   again and every stream finishes whole.
2. Failed, at `--engine-stall-exit-seconds` without a step (0: never): handled exactly as
   engine death — every request in flight ends UNAVAILABLE saying why, and the server exits
   non-zero so its supervisor restarts the worker.

The watchdog reads `AsyncEngine.progress()`, never a call into the engine that would hang
too — except, once out of rotation with no request left to step, one question at a time
(`is_paused`) whose answer shows the engine's loop runs. An idle engine is never judged, nor
one held on purpose (paused or asleep, from the moment the call to hold it starts). With data
parallelism a step of any rank counts (vLLM's scheduler stats do not say which requests a rank
holds): a collective that wedges stops every rank, but one rank stuck while another steps is
not found here.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from dataclasses import dataclass

from ..engine import AsyncEngine
from ..errors import EngineUnavailable
from .health import ServingState
from .metrics import ServicerMetrics
from .requests import RequestTable

logger = logging.getLogger(__name__)

# Stage 1. A long prefill is chunked into steps (vLLM's default scheduler), so even a huge
# prompt on a large model on a GPU makes a step every second or two; two minutes of silence
# with work waiting is worth taking the worker out of rotation (which costs nothing if it
# recovers: it is back at its next step).
DEFAULT_TIMEOUT_SECONDS = 120.0
# Stage 2, argued in docs/operations.md ("A stalled engine"): past what the long steps that
# recover take (a large model's prefill chunk on vLLM-CPU, a LoRA load from slow storage, a
# compile, a swap storm: seconds to a few minutes), and no later than vLLM's own limit on
# one model step (VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS, 300 s, which it applies in its
# multiprocess executor only): every stream on a wedged worker waits until this, and a
# router cannot retry a stream elsewhere before it ends.
DEFAULT_EXIT_SECONDS = 300.0


class StallStage(enum.IntEnum):
    """What the watchdog has made of the engine (the `engine_stall_stage` gauge)."""

    PROGRESSING = 0
    OUT_OF_ROTATION = 1
    FAILED = 2


@dataclass(frozen=True, slots=True)
class StallLimits:
    """Seconds without a step, with work waiting, before each stage (exit 0: never)."""

    timeout: float = DEFAULT_TIMEOUT_SECONDS
    exit: float = DEFAULT_EXIT_SECONDS

    def check(self) -> str | None:
        """Why these limits cannot work together (None: they can)."""
        if self.timeout < 0 or self.exit < 0:
            return "the engine stall limits must not be negative"
        if self.timeout and self.exit and self.exit <= self.timeout:
            return (
                f"--engine-stall-exit-seconds ({self.exit:g}) must be longer than "
                f"--engine-stall-timeout-seconds ({self.timeout:g}): the worker leaves "
                "rotation at the first and fails its streams and exits at the second"
            )
        return None


def out_of_rotation_message(seconds: float) -> str:
    return (
        f"the engine has made no step for over {seconds:.0f}s while requests were running; "
        "this worker is out of rotation until it steps again (retry on another worker)"
    )


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


class ProgressWatchdog:
    """The two stages (see the module doc) for one server's engine."""

    def __init__(
        self,
        engine: AsyncEngine,
        state: ServingState,
        requests: RequestTable,
        limits: StallLimits,
        metrics: ServicerMetrics | None = None,
    ) -> None:
        self._engine = engine
        self._state = state
        self._requests = requests
        self._limits = limits
        self._metrics = metrics
        self.stage = StallStage.PROGRESSING
        # Out of rotation: the engine's latest step when it left, and its answer to the
        # question asked once it had no request left to step.
        self._left_at_step = 0.0
        self._probe: asyncio.Future[bool] | None = None

    async def run(self) -> None:
        """Until the engine is failed (then handle it and return) or cancelled."""
        if self._engine.progress().last_step is None:
            logger.warning(
                "This engine does not report its steps: no progress watchdog (a stuck engine "
                "is found only when it dies)"
            )
            return
        try:
            while not self._state.engine_dead and self.stage is not StallStage.FAILED:
                await asyncio.sleep(min(1.0, self._limits.timeout / 4))
                await self.check()
        finally:
            if self._probe is not None:
                self._probe.cancel()

    async def check(self, now: float | None = None) -> None:
        """One look at the engine: enter, leave or pass a stage."""
        progress = self._engine.progress()
        if progress.last_step is None:
            return
        now = time.monotonic() if now is None else now
        silent = now - progress.last_step
        if self.stage is StallStage.PROGRESSING:
            if progress.busy and silent > self._limits.timeout:
                await self._leave_rotation(silent)
            return
        if progress.last_step > self._left_at_step or self._answered():
            await self._rejoin_rotation(now - self._left_at_step)
        elif progress.held:
            return  # held on purpose meanwhile: never judged, and no question asked
        elif self._limits.exit and silent > self._limits.exit:
            await self._fail(silent)
        elif not progress.busy and self._probe is None:
            # No request left to step: a step will not come to say it runs again.
            self._probe = asyncio.ensure_future(self._engine.is_paused())

    def _answered(self) -> bool:
        probe = self._probe
        if probe is None or not probe.done():
            return False
        self._probe = None
        return not probe.cancelled() and probe.exception() is None

    async def _leave_rotation(self, silent: float) -> None:
        progress = self._engine.progress()
        self._left_at_step = progress.last_step or 0.0
        exit_at = self._limits.exit
        logger.error(
            "Engine stalled: no step for %.1fs with %d request(s) in flight (--engine-stall-"
            "timeout-seconds %.1f): out of rotation (NOT_SERVING, new requests refused), the "
            "streams in flight keep waiting; %s",
            silent,
            len(self._requests.in_flight),
            self._limits.timeout,
            f"failed at {exit_at:.1f}s without a step (--engine-stall-exit-seconds)"
            if exit_at
            else "never failed (--engine-stall-exit-seconds 0)",
        )
        self._count("out_of_rotation")
        await self._state.leave_rotation(out_of_rotation_message(self._limits.timeout))
        self.stage = StallStage.OUT_OF_ROTATION  # once every health surface says so

    async def _rejoin_rotation(self, stalled: float) -> None:
        if self._probe is not None:
            self._probe.cancel()
            self._probe = None
        logger.warning(
            "Engine stepped again after a stall of %.1fs: back in rotation (SERVING)", stalled
        )
        self._count("recovered")
        await self._state.rejoin_rotation()
        self.stage = StallStage.PROGRESSING

    async def _fail(self, silent: float) -> None:
        message = stuck_message(silent)
        logger.error(
            "Engine stuck: no step for %.1fs with %d request(s) in flight (--engine-stall-exit-"
            "seconds %.1f); failing them and the worker",
            silent,
            len(self._requests.in_flight),
            self._limits.exit,
        )
        self._count("failed")
        await self._state.engine_died(f"no engine step for {silent:.1f}s", reason=message)
        self._requests.fail_all(EngineUnavailable(message))
        self.stage = StallStage.FAILED

    def _count(self, stage: str) -> None:
        if self._metrics is not None:
            self._metrics.engine_stalls.labels(stage).inc()
