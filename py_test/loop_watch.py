"""Where the session's event loop stood still, and which test or fixture held it.

The session-shared workers (`real`, the servers lent its engine) run in this process, on the
session's event loop, and answer nothing while that loop stands still: while a synchronous
test or fixture runs, or an async one blocks without awaiting. Their routers cannot tell that
from a wedged worker. SMG and vllm-router probe a worker's health every 60 s with a 5 s
timeout, take it out of rotation after 3 missed probes and back only after 2 answered ones,
so a stand-still of a few minutes (a slow machine starting a reference server in a
synchronous fixture) leaves every later test that uses those routers with HTTP 503 for up to
two more minutes. The watch records each stand-still longer than a probe's timeout with the
phases (tests and fixtures) that ran during it; the shared-router fixtures name them when
their router has lost its worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass

# A router's health probe times out after this long (SMG and vllm-router both default to 5 s):
# a stand-still longer than this can cost a probe.
PROBE_TIMEOUT = 5.0
BEAT = 0.25


@dataclass(frozen=True)
class Standstill:
    seconds: float
    during: tuple[str, ...]  # the phases that ran while the loop stood still, in order

    def __str__(self) -> str:
        # The first and the last phase ran the loop at the edges; those between did not.
        named = self.during if len(self.during) <= 8 else (
            *self.during[:6], f"... {len(self.during) - 7} more ...", self.during[-1]
        )  # fmt: skip
        return f"{self.seconds:.0f} s: {' | '.join(named)}"


class LoopWatch:
    """Beats on the session loop every BEAT seconds; a gap longer than PROBE_TIMEOUT is a
    stand-still, blamed on the phases pytest entered meanwhile (see the conftest hooks)."""

    def __init__(self) -> None:
        self.standstills: list[Standstill] = []
        self.loop: asyncio.AbstractEventLoop | None = None  # the session's, once it runs
        self._phases: list[str] = []
        self._since_beat: list[str] = []

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Name what runs within (a test's setup, call or teardown, a fixture's setup)."""
        self._phases.append(name)
        self._since_beat.append(name)
        try:
            yield
        finally:
            self._phases.pop()
            if self._phases:
                self._since_beat.append(self._phases[-1])

    async def run(self) -> None:
        self.loop = asyncio.get_running_loop()
        last = time.monotonic()
        while True:
            await asyncio.sleep(BEAT)
            now = time.monotonic()
            if now - last > PROBE_TIMEOUT:
                during = tuple(dict.fromkeys(self._since_beat))  # in order, once each
                self.standstills.append(Standstill(now - last, during))
            last = now
            self._since_beat = [self._phases[-1]] if self._phases else []


LOOP_WATCH = LoopWatch()
