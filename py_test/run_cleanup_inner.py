"""The inner run of test_run_cleanup.py (not collected: run on its own by that test).

Session fixtures start a process of every kind the suite starts, each the way the suite
starts it; the test records their pids and the run's id, then waits to be ended
(RUN_CLEANUP_HOW: "passes" and "fails" end by themselves).
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from multiprocessing.process import BaseProcess
from pathlib import Path

import pytest

import routers
import servers
from reaper import RUN, SHARED_MEMORY_DIR

if "RUN_CLEANUP_OUT" not in os.environ:
    pytest.skip("the inner run of test_run_cleanup.py", allow_module_level=True)

# A server in a session of its own (as vllm-rs or vLLM's OpenAI server) whose engine runs in
# yet another session; on SIGTERM it ends that engine first, as a well-behaved server does.
SESSION_SERVER = """
import signal, subprocess, sys, time
engine = subprocess.Popen(["sleep", "600"], start_new_session=True)
def stop(*_):
    engine.kill(); engine.wait(); sys.exit(0)
signal.signal(signal.SIGTERM, stop)
print(engine.pid, flush=True)
time.sleep(600)
"""
# A child in pytest's own process group that only SIGKILL ends (a wedged engine).
STUBBORN = """
import signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("ready", flush=True)
time.sleep(600)
"""


@pytest.fixture(scope="session")
async def servicer() -> AsyncIterator[int]:
    """The mock-engine servicer, started as the lifecycle tests start it (own session)."""
    server = await servers.start("--mock-engine", "--port", "0")
    yield server.process.pid
    await server.stop()


@pytest.fixture(scope="session")
def session_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, int]]:
    """(server, its engine), started by the launcher of the routers and vllm-rs."""
    log = tmp_path_factory.mktemp("server") / "server.log"
    command = [sys.executable, "-c", SESSION_SERVER]
    with routers._running(command, log, lambda: log.read_text().strip() != "", "server") as p:
        yield p.pid, int(log.read_text().split()[0])


def _engine_core(process_class: Callable[..., BaseProcess]) -> Iterator[int]:
    # How vLLM's in-process AsyncLLM starts its engine core: spawned on CPU, forked on a GPU.
    process = process_class(target=time.sleep, args=(600,), daemon=True)
    process.start()
    assert process.pid is not None
    yield process.pid
    process.terminate()
    process.join()


@pytest.fixture(scope="session")
def spawned_engine_core() -> Iterator[int]:
    yield from _engine_core(multiprocessing.get_context("spawn").Process)


@pytest.fixture(scope="session")
def forked_engine_core() -> Iterator[int]:
    # Its /proc environ is pytest's own, from before the run had an id: found by its fork record.
    yield from _engine_core(multiprocessing.get_context("fork").Process)


@pytest.fixture(scope="session")
def stubborn() -> Iterator[int]:
    process = subprocess.Popen([sys.executable, "-c", STUBBORN], stdout=subprocess.PIPE)
    assert process.stdout is not None
    process.stdout.readline()
    yield process.pid
    process.kill()
    process.wait()


async def test_hold(
    servicer: int,
    session_server: tuple[int, int],
    spawned_engine_core: int,
    forked_engine_core: int,
    stubborn: int,
) -> None:
    server, engine = session_server
    pids = {
        "servicer": servicer,
        "server": server,
        "server's engine": engine,
        "spawned engine core": spawned_engine_core,
        "forked engine core": forked_engine_core,
        "stubborn": stubborn,
    }
    run = os.environ[RUN].split(":")[-1]
    # What an engine core ended by SIGKILL leaves: its ring, which no process maps.
    ring = SHARED_MEMORY_DIR / f"psm_run_cleanup_{run}"
    ring.write_bytes(b"\0" * 4096)
    out = Path(os.environ["RUN_CLEANUP_OUT"])
    part = out.with_suffix(".part")
    part.write_text(json.dumps({"run": run, "pids": pids, "ring": str(ring)}))
    part.rename(out)  # whole, or not there
    how = os.environ["RUN_CLEANUP_HOW"]
    assert how != "fails", "this run fails on purpose"
    if how != "passes":
        # In the event loop, as most of the suite's tests wait: the signal lands in it.
        await asyncio.sleep(600)  # until the case ends the run
