"""A test run leaves no process behind, however it ends (issue 35; reaper.py).

Each case runs an inner pytest (run_cleanup_inner.py, under the suite's own conftest and
settings) whose session fixtures start a process of every kind the suite starts, each the
way the suite starts it, and ends that run one way. Then no process carrying the inner
run's id may be left, its watcher included, nor any process it recorded. The inner runs
start together (their start-up is most of the time); each case ends its own.
"""

from __future__ import annotations

import json
import mmap
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from reaper import LEFT_RUNNING, RUN, SHARED_MEMORY_DIR

HERE = Path(__file__).resolve().parent
INNER = HERE / "run_cleanup_inner.py"

# How each case ends the inner run: (signal, to its whole process group?, pytest's exit code);
# no signal: it ends by itself. A whole group is what `timeout` (a CI job's time limit), a CI
# cancel and Ctrl-C at a terminal signal: make, its shell and pytest together.
ENDINGS: dict[str, tuple[signal.Signals | None, bool, int]] = {
    "passes": (None, False, 0),
    "fails": (None, False, 1),
    "Ctrl-C": (signal.SIGINT, True, 2),
    "SIGTERM to the group (timeout, CI cancel, make)": (signal.SIGTERM, True, 2),
    "SIGTERM to pytest": (signal.SIGTERM, False, 2),  # ends as Ctrl-C: teardown runs
    "SIGKILL to pytest": (signal.SIGKILL, False, -signal.SIGKILL),
    "SIGKILL to the group (timeout --kill-after)": (signal.SIGKILL, True, -signal.SIGKILL),
}
GRACE = 2.0  # the inner watcher's SIGTERM..SIGKILL wait
START_TIMEOUT = 60.0
# Teardown of seven runs at once on a loaded 2-core machine (the full venv, the whole suite
# around it) took over 15 s in a CI run; a hang still fails it.
END_TIMEOUT = 60.0


def _interruptible() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class InnerRun:
    """`pytest py_test/run_cleanup_inner.py` as `make test` runs the suite (same conftest,
    same settings), in a process group of its own as under `timeout`."""

    def __init__(self, directory: Path, how: str) -> None:
        directory.mkdir()
        self.out = directory / "pids.json"
        self.log = directory / "pytest.log"
        env = {
            **os.environ,
            "RUN_CLEANUP_OUT": str(self.out),
            "RUN_CLEANUP_HOW": how,
            "VLLM_SERVICER_REAPER_GRACE": str(GRACE),
        }
        command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q",
                   "--basetemp", str(directory / "tmp"), str(INNER)]  # fmt: skip
        with open(self.log, "w") as log:
            self.process = subprocess.Popen(
                command,
                cwd=HERE.parent,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                # As at a terminal: a shell that starts a job in the background (a CI runner
                # may) leaves SIGINT ignored, and Python then never raises KeyboardInterrupt.
                preexec_fn=_interruptible,
            )

    def started(self) -> dict[str, Any]:
        """What the inner test recorded, once every fixture is up."""
        deadline = time.monotonic() + START_TIMEOUT
        while not self.out.exists():
            assert self.process.poll() is None or self.out.exists(), self.output()
            assert time.monotonic() < deadline, f"inner run not up: {self.output()}"
            time.sleep(0.1)
        return json.loads(self.out.read_text())

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def kill(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()


def carrying(run: str) -> list[psutil.Process]:
    """Processes whose environment names the run (read with psutil, not the reaper's code)."""
    found = []
    for process in psutil.process_iter():
        try:
            if run in process.environ().get(RUN, "").split(":"):
                found.append(process)
        except (psutil.Error, OSError):  # gone, a zombie, or not ours to read
            pass
    return found


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture(scope="module")
def inner_runs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, InnerRun]]:
    """One inner run per selected case, all started at once."""
    selected = [
        str(item.callspec.params["how"])
        for item in request.session.items
        if isinstance(item, pytest.Function)
        and item.function is test_a_run_leaves_no_process_behind
    ]
    base = tmp_path_factory.mktemp("runs")
    runs = {how: InnerRun(base / f"run{i}", how) for i, how in enumerate(selected)}
    try:
        yield runs
    finally:
        for run in runs.values():
            run.kill()


@pytest.mark.parametrize("how", list(ENDINGS))
def test_a_run_leaves_no_process_behind(how: str, inner_runs: dict[str, InnerRun]) -> None:
    run = inner_runs[how]
    record = run.started()
    run_id, pids = record["run"], record["pids"]
    # A ring this process maps, made during the inner run: live, so never the run's to remove.
    live = SHARED_MEMORY_DIR / f"psm_run_cleanup_live_{run_id}"
    live.write_bytes(b"\0" * 4096)
    with open(live, "r+b") as file:
        mapping = mmap.mmap(file.fileno(), 4096)
    sig, group, exit_code = ENDINGS[how]
    if sig is not None:
        up = {process.pid for process in carrying(run_id)}
        exec_started = {pid for name, pid in pids.items() if name != "forked engine core"}
        assert exec_started <= up, (pids, up, run.output())
        if group:
            os.killpg(run.process.pid, sig)
        else:
            run.process.send_signal(sig)
    assert run.process.wait(END_TIMEOUT) == exit_code, run.output()

    deadline = time.monotonic() + END_TIMEOUT
    while (left := carrying(run_id)) or any(alive(pid) for pid in pids.values()):
        if time.monotonic() > deadline:
            remaining = {name: pid for name, pid in pids.items() if alive(pid)}
            pytest.fail(f"{how}: left {left} {remaining}\n{run.output()}")
        time.sleep(0.1)

    # The run's leftover shared memory is gone once its watcher is (it carries the run's id);
    # what a live process maps is still there.
    assert not Path(record["ring"]).exists(), run.output()
    assert live.exists()
    mapping.close()
    live.unlink()

    output = run.output()
    if exit_code >= 0:
        # pytest tore its fixtures down (after SIGTERM as after Ctrl-C): the watcher found
        # nothing left to end.
        assert LEFT_RUNNING not in output, output
    else:
        # No teardown: the watcher ended what the signal missed. That is every process in a
        # session of its own (the server's engine it may find ended by its server) and, when
        # only pytest was signalled, its group's too: the stubborn one needed SIGKILL.
        assert LEFT_RUNNING in output, output
        missed = {"servicer", "server"} if group else set(pids) - {"server's engine"}
        for name in missed:
            sent = "SIGKILL" if name == "stubborn" else "SIG"  # others: SIGTERM, or late
            assert f"\n  {pids[name]} {sent}" in output, (name, output)
