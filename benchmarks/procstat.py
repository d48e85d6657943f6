"""CPU time and memory of a process, read from /proc (Linux): the steadier measure.

Wall-clock throughput on a 2-core machine shared by client, server and engine moves
with everything else; the CPU a front-end process spends per generated token does not.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int | None = None) -> float:
    """user + system CPU of one process (all its threads; not its children)."""
    if pid is None:
        return time.process_time()
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat.rsplit(")", 1)[1].split()  # the name may contain spaces
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime


def rss_mb(pid: int | None = None) -> float:
    status = Path(f"/proc/{pid or 'self'}/status").read_text()
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class CpuWindow:
    """CPU seconds of some processes between `start()` and `stop()`."""

    def __init__(self, *pids: int | None) -> None:
        self._pids = pids
        self._start: list[float] = []
        self.seconds: list[float] = []

    def start(self) -> None:
        self._start = [cpu_seconds(pid) for pid in self._pids]

    def stop(self) -> list[float]:
        self.seconds = [
            cpu_seconds(pid) - s for pid, s in zip(self._pids, self._start, strict=True)
        ]
        return self.seconds
