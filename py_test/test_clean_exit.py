"""What an operator sees when the worker stops: after "Server stopped", nothing from libraries.

A clean stop exits 0 once the atexit handlers have run, without the interpreter's
finalization (server/process_exit.py), where triton's nanobind bindings, which vLLM imports
even on CPU, printed ~30 lines of "nanobind: leaked ...". vLLM's engine-core process is given
the time to finish its own teardown (engine/vllm/shutdown.py): killed in the middle of it, it
left its shared-memory ring to Python's resource tracker, which warned of "leaked
shared_memory objects". Both stops are checked: Ctrl-C (SIGINT to the whole foreground
process group, the engine's processes included, as a terminal sends it) and SIGTERM to the
worker alone (Kubernetes). An error path (engine death) keeps the ordinary exit: non-zero,
finalization and all.
"""

from __future__ import annotations

import multiprocessing
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import grpc
import psutil
import pytest

from vllm_router.engine.vllm.shutdown import catches_sigterm, shutdown_engine
from vllm_router.proto import vllm_engine_pb2_grpc as pb_grpc

import servers
from harness import read_rest, request
from real_engine import BASE_FLAGS, cli_flags, require_vllm, tiny_model

# Run in the server's process before the CLI: an atexit handler that says it ran and leaves
# an object only the interpreter's finalization frees (in a module of its own, made after the
# start-up heap was frozen: frozen objects outlive finalization), which says so when freed.
PLANTED = (
    "import atexit, sys, types\n"
    "class _Finalized:\n"
    "    def __del__(self):\n"
    "        sys.stderr.write('finalization ran\\n')\n"
    "def _at_exit():\n"
    "    sys.stderr.write('atexit ran\\n')\n"
    "    probe = types.ModuleType('_finalization_probe')\n"
    "    probe.finalized = _Finalized()\n"
    "    sys.modules[probe.__name__] = probe\n"
    "atexit.register(_at_exit)\n"
)
MOCK = ("--mock-engine", "--port", "0")
# What libraries printed on the way out before (issue 55): none of it may appear.
NOISE = re.compile(r"nanobind: leaked|resource_tracker|leaked shared_memory")


def _stop(server: servers.ServerProcess, how: str) -> None:
    if how == "ctrl-c":
        # A terminal's Ctrl-C: SIGINT to the foreground process group (the server runs in a
        # session of its own, so its group is its pid), vLLM's processes included.
        os.killpg(server.process.pid, signal.SIGINT)
    else:
        server.process.send_signal(signal.SIGTERM)


def _after_stopped(log: str) -> str:
    assert "Server stopped" in log, log[-3000:]
    return log.split("Server stopped", 1)[1]


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
async def test_a_clean_stop_runs_atexit_handlers_then_skips_finalization(
    how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(servers, "WITHOUT_VLLM", PLANTED + servers.WITHOUT_VLLM)
    server = await servers.start(*MOCK, without_vllm=True)
    try:
        _stop(server, how)
        assert await server.wait(15) == 0
    finally:
        server.kill()
    after = _after_stopped("".join(server.log))
    assert "atexit ran" in after
    assert "finalization ran" not in after
    assert after.strip() == "atexit ran", after


async def test_an_engine_death_keeps_the_ordinary_exit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(servers, "WITHOUT_VLLM", PLANTED + servers.WITHOUT_VLLM)
    server = await servers.start(
        *MOCK, "--mock-step-delay", "0.01", "--mock-die-after-tokens", "5", without_vllm=True
    )
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            stream = pb_grpc.VllmEngineStub(channel).GenerateStream(request([10], max_tokens=50))
            with pytest.raises(grpc.aio.AioRpcError):
                await read_rest(stream)
        assert await server.wait(15) == 1
    finally:
        server.kill()
    log = "".join(server.log)
    assert "Engine is dead" in log
    after = _after_stopped(log)
    # Finalization ran, as it always did: nothing on an error path is hidden.
    assert "atexit ran" in after and "finalization ran" in after, after


class _FakeLLM:
    """What shutdown_engine reads of vLLM's AsyncLLM, around one engine-core process."""

    def __init__(self, process: multiprocessing.process.BaseProcess) -> None:
        manager = SimpleNamespace(processes=[process])
        self.engine_core = SimpleNamespace(
            resources=SimpleNamespace(engine_manager=manager, engine_dead=False)
        )
        self.process = process
        self.shutdowns: list[tuple[bool, float]] = []

    def shutdown(self, timeout: float) -> None:
        self.shutdowns.append((self.process.is_alive(), timeout))
        self.process.join(timeout)


async def test_an_engine_core_in_its_own_teardown_is_waited_for_not_sigtermed() -> None:
    # A process with SIGTERM at its default action: an engine core that got the terminal's
    # SIGINT and tears down (vLLM's run_engine_core resets its handlers first).
    process = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(1.5,))
    process.start()
    try:
        llm = _FakeLLM(process)
        assert catches_sigterm(process.pid or 0) is False
        await shutdown_engine(llm, timeout=30)
        # vLLM's shutdown came once the process had exited by itself, with the time left.
        assert len(llm.shutdowns) == 1 and llm.shutdowns[0][0] is False, llm.shutdowns
        assert llm.shutdowns[0][1] > 20, llm.shutdowns
        assert process.exitcode == 0  # not killed by a signal
        # vLLM's monitor thread is told the engine core is going, not crashing.
        assert llm.engine_core.resources.engine_dead is True
    finally:
        process.kill()
        process.join()


def _sleeper(handler: str) -> subprocess.Popen[str]:
    """A Python process with `handler` for SIGTERM, once it is installed."""
    code = f"import signal, sys, time; signal.signal(signal.SIGTERM, {handler}); print('set')\n"
    code += "sys.stdout.flush(); time.sleep(30)"
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None and child.stdout.readline() == "set\n"
    return child


def test_catches_sigterm_reads_the_handler_of_a_process() -> None:
    for handler, caught in (("lambda *_: None", True), ("signal.SIG_DFL", False)):
        child = _sleeper(handler)
        try:
            assert catches_sigterm(child.pid) is caught, handler
        finally:
            child.kill()
            child.wait()
    assert catches_sigterm(child.pid) is None  # gone


def _shared_memory(pid: int) -> set[str]:
    """The /dev/shm/psm_* objects mapped by `pid` and its descendants."""
    names: set[str] = set()
    parent = psutil.Process(pid)
    for proc in [parent, *parent.children(recursive=True)]:
        try:
            maps = Path(f"/proc/{proc.pid}/maps").read_text()
        except OSError:
            continue
        names.update(re.findall(r"/dev/shm/(psm_\w+)", maps))
    return names


def _still_in_dev_shm(names: set[str]) -> list[str]:
    return sorted(name for name in names if os.path.exists(f"/dev/shm/{name}"))


# Ctrl-C only on the real engine (each case starts an engine of its own, ~90 s): SIGTERM
# takes the same shutdown_engine path, held on the mock above and by the unit tests below.
@pytest.mark.vllm
@pytest.mark.parametrize("how", ["ctrl-c"])
async def test_the_real_engine_stops_with_nothing_after_server_stopped(how: str, figures) -> None:
    require_vllm()
    model = tiny_model()
    server = await servers.start(
        "--model", str(model), "--port", "0", *cli_flags(BASE_FLAGS), timeout=240
    )  # fmt: skip
    try:
        rings = _shared_memory(server.process.pid)
        asked = time.monotonic()
        _stop(server, how)
        # The engine core's own teardown takes seconds (its worker's exit 3-4 s here).
        code = await server.wait(60)
        took = time.monotonic() - asked
    finally:
        server.kill()
    log = "".join(server.log)
    figures(f"{how}: exit {code} {took:.1f}s after the signal; shared memory {sorted(rings)}")
    assert code == 0, log[-3000:]
    assert not NOISE.findall(log), _after_stopped(log)
    # vLLM's engine core was neither killed nor taken for a crash.
    assert "force killing" not in log and "exited unexpectedly" not in log, log[-3000:]
    assert "output_handler failed" not in log, log[-3000:]
    assert _after_stopped(log).strip() == "", _after_stopped(log)
    # The engine's shared-memory rings were unlinked by the processes that made them.
    assert rings, "no psm_ shared memory seen: vLLM's rings changed (update this test)"
    assert not _still_in_dev_shm(rings)
