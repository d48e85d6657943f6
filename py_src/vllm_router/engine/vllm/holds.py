"""Holds: pause, resume, sleep and wake-up on vLLM's AsyncLLM, and whether the engine holds
its requests on purpose (what the stall watchdog must not judge).

The rule, one for every hold (docs/operations.md, "Holds"):
- Held is what the engine says once a call has returned: paused (`is_paused`) or asleep
  (`is_sleeping`, which stays true after a partial wake-up: vLLM's `wake_up(tags)` returns
  whether the engine is fully awake, and its core schedules again only when it is).
- While a call runs, nothing is held: a pause or a sleep whose call never returns (a wedged
  engine core cannot answer it) is judged by the stall limits like any silence with work
  waiting, out of rotation and then failed on time, whatever it was asked to do.
- A call runs to its end when its caller leaves (a deadline does not cut vLLM's call in
  half), and the engine's answer restarts the watchdog's clock: held requests start
  moving when they are released, not when they were held.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from ...errors import EngineDead
from .params import reraise

logger = logging.getLogger(__name__)


class Holds:
    """The holds of one AsyncLLM (see the module doc); `answered` is called whenever the
    engine answered a hold call (its loop runs: the stall clock starts anew)."""

    def __init__(self, llm: Any, answered: Callable[[], None]) -> None:
        self._llm = llm
        self._answered = answered
        self.held = False

    async def pause(self, mode: str, clear_cache: bool) -> None:
        await self._settled(lambda: self._llm.pause_generation(mode=mode, clear_cache=clear_cache))

    async def resume(self) -> None:
        await self._settled(self._llm.resume_generation)

    async def sleep(self, level: int, mode: str, **options: Any) -> None:
        await self._settled(lambda: self._llm.sleep(level, mode, **options))

    async def wake_up(self, tags: list[str] | None) -> None:
        await self._settled(lambda: self._llm.wake_up(tags))

    async def _settled(self, call: Callable[[], Awaitable[object]]) -> None:
        if self._llm.errored:
            raise EngineDead("vLLM engine is dead; retry on another worker")
        settling = asyncio.ensure_future(self._settle(call()))
        settling.add_done_callback(_retrieved)  # a caller that left does not read it
        await asyncio.shield(settling)

    async def _settle(self, call: Awaitable[object]) -> None:
        try:
            await call
        except Exception as exc:
            await self._ask()
            reraise(exc)
        await self._ask()

    async def _ask(self) -> None:
        """Held as the engine says it now is."""
        try:
            held = bool(await self._llm.is_paused()) or bool(await self._llm.is_sleeping())
        except Exception as exc:  # a dead engine is found by its own paths
            logger.warning("Could not ask the engine whether it is paused or asleep: %s", exc)
            return
        self.held = held
        self._answered()


def _retrieved(task: asyncio.Future[None]) -> None:
    if not task.cancelled():
        task.exception()
