"""The vLLM adapter's held mark (what keeps the progress watchdog from judging a paused or
sleeping engine) follows what the engine did, not what the caller saw: set when a pause or
sleep has returned (never while its call is out: a call a wedged core never answers is
judged), kept when the caller leaves mid-call (the call runs to its end), and, when a call
fails, taken from the engine's own answer. Unit tests of `VllmEngine.progress()` over a
stand-in AsyncLLM; the holds' own rules, sleep included: test_holds.py."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from vllm_router.engine.vllm.adapter import VllmEngine
from vllm_router.engine.vllm.holds import Holds
from vllm_router.engine.vllm.stats import LoadBoard
from vllm_router.errors import ServicerError

pytestmark = pytest.mark.vllm  # a failed call is translated by vLLM's own exception types


class _Processor:
    def __init__(self) -> None:
        self.request_states = {"r": object()}  # one request the engine owes steps


class _Llm:
    """What the adapter's holds call on AsyncLLM; each call waits for `release` when set."""

    errored = False

    def __init__(self) -> None:
        self.output_processor = _Processor()
        self.paused = False
        self.release: asyncio.Event | None = None
        self.fail: Exception | None = None
        self.calls: list[str] = []

    async def _run(self, name: str, paused_after: bool) -> None:
        self.calls.append(name)
        if self.release is not None:
            await self.release.wait()
        if self.fail is not None:
            raise self.fail
        self.paused = paused_after

    async def pause_generation(self, **_: Any) -> None:
        await self._run("pause", True)

    async def resume_generation(self) -> None:
        await self._run("resume", False)

    async def is_paused(self) -> bool:
        return self.paused

    async def is_sleeping(self) -> bool:
        return False


def _engine() -> tuple[VllmEngine, _Llm]:
    llm = _Llm()
    engine = object.__new__(VllmEngine)  # only the parts a hold uses
    engine._llm = llm  # type: ignore[assignment]
    engine._board = LoadBoard(1)
    engine._holds = Holds(llm, engine._board.stepped)
    engine._progress = True
    return engine, llm


async def test_a_pause_is_held_once_it_returns_also_when_its_caller_leaves() -> None:
    engine, llm = _engine()
    llm.release = asyncio.Event()
    caller = asyncio.ensure_future(engine.pause("keep", clear_cache=False))
    await asyncio.sleep(0.01)
    # Mid-call: nothing held yet, the engine's silence with work owed is judged.
    assert llm.calls == ["pause"] and not engine.progress().held
    assert engine.progress().busy
    caller.cancel()  # the caller's deadline
    with pytest.raises(asyncio.CancelledError):
        await caller
    llm.release.set()
    await asyncio.sleep(0.01)
    assert llm.paused and engine.progress().held and not engine.progress().busy


async def test_a_resume_whose_caller_leaves_still_releases() -> None:
    engine, llm = _engine()
    await engine.pause("keep", clear_cache=False)
    llm.release = asyncio.Event()
    caller = asyncio.ensure_future(engine.resume())
    await asyncio.sleep(0.01)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert engine.progress().held  # not yet resumed
    before = engine.progress().last_step
    llm.release.set()
    await asyncio.sleep(0.01)
    progress = engine.progress()
    assert not llm.paused and not progress.held and progress.busy
    assert progress.last_step is not None and before is not None and progress.last_step > before


@pytest.mark.parametrize("paused_after", [True, False])
async def test_a_failed_call_asks_the_engine_whether_it_holds(paused_after: bool) -> None:
    engine, llm = _engine()
    await engine.pause("keep", clear_cache=False)
    llm.fail = RuntimeError("resume failed in the engine")
    llm.paused = paused_after  # what the engine is left in, whatever the call did
    with pytest.raises((ServicerError, RuntimeError)):
        await engine.resume()
    assert engine.progress().held is paused_after
    # And a pause that failed without pausing leaves nothing held.
    llm.paused = False
    with pytest.raises((ServicerError, RuntimeError)):
        await engine.pause("abort", clear_cache=True)
    assert not engine.progress().held
