"""Every process a test run starts ends with the run, however the run ends (issue 35).

The reference servers, routers and engines run in sessions of their own, so a signal that
ends pytest (timeout, a CI cancel, Ctrl-C) never reaches them, and pytest killed outright
runs no fixture teardown. conftest's pytest_configure calls `tie_processes_to_run()`:

- the run's id goes into the environment (RUN), so every process the run starts, at any
  depth and in any session, carries it in /proc/PID/environ (a list: a run started inside
  another run carries both ids, and either run's end ends it);
- a fork without exec keeps its parent's original /proc environ, so a forked child (vLLM
  forks its engine core where CUDA is not yet initialised) writes its pid and start time
  to the run's forks file instead;
- a watcher (this file run as a script, in a session of its own, deaf to SIGTERM, SIGINT
  and SIGHUP) holds the read end of a pipe only pytest writes to. Once pytest has exited,
  however, it gives the run's processes SETTLE seconds to end by themselves, SIGTERMs those
  left, SIGKILLs those left GRACE seconds later, and lists on stderr what it had to end:
  nothing, when fixture teardown has run;
- SIGTERM to pytest ends the run as Ctrl-C does (fixture teardown runs); a second SIGTERM
  ends it at once, the watcher cleaning up;
- then the watcher removes the shared memory the run left in /dev/shm: vLLM's message-queue
  rings (`psm_*`, up to 240 MB each) and multiprocessing's semaphores (`sem.mp-*`) created
  since the run began that no process maps any more. vLLM unlinks them in its own teardown
  only, and the fault tests SIGKILL engine cores on purpose (four engines' rings, 1.6 GB of
  memory, were left by each run before). What any live process maps is never touched.

Not a parent-death signal (PR_SET_PDEATHSIG): it fires when the *thread* that started the
child ends, and the routers are started from worker threads (routers.in_thread).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

RUN = "VLLM_SERVICER_TEST_RUN"
GRACE = float(os.environ.get("VLLM_SERVICER_REAPER_GRACE", "5"))  # SIGTERM..SIGKILL, seconds
SETTLE = 2.0  # seconds
LEFT_RUNNING = "it left these running, ended now:"  # the watcher's report, when it ends any
_watcher: list[subprocess.Popen] = []  # held, so it is never collected (and warned about)
SHARED_MEMORY_DIR = Path("/dev/shm")
SHARED_MEMORY = ("psm_", "sem.mp-")  # vLLM's rings, multiprocessing's named semaphores


def _run_ids(environ: bytes) -> list[str]:
    """The run ids in a process's environment, as read from /proc/PID/environ."""
    for entry in environ.split(b"\0"):
        if entry.startswith(RUN.encode() + b"="):
            return entry.split(b"=", 1)[1].decode(errors="replace").split(":")
    return []


def _start_time(pid: int | str) -> str:
    # Field 22 of /proc/PID/stat, after the parenthesised name (which may hold spaces).
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]


def _forks_file(run: str) -> Path:
    return Path(tempfile.gettempdir()) / f"vllm-servicer-run-{run}.forks"


def tie_processes_to_run() -> str:
    """Give this run an id, start its watcher, make SIGTERM end it as Ctrl-C does."""
    run = uuid.uuid4().hex
    inherited = os.environ.get(RUN)
    os.environ[RUN] = f"{inherited}:{run}" if inherited else run
    if threading.current_thread() is threading.main_thread():  # where handlers can be set
        signal.signal(signal.SIGTERM, _interrupt)
    if not Path("/proc/self/environ").exists():  # the watcher reads /proc: Linux only
        return run
    read_end, write_end = os.pipe()  # non-inheritable: no exec'd child keeps the run open
    watcher = subprocess.Popen(
        [sys.executable, __file__, run, str(read_end), str(os.getpid())],
        pass_fds=(read_end,),
        stdin=subprocess.DEVNULL,
        start_new_session=True,  # the signal that ends the run's process group misses it
    )
    os.close(read_end)
    _watcher.append(watcher)
    forks = _forks_file(run)
    # Emptied in the first forked child, so its own forks (which inherit it emptied) never
    # close a number it has since given to another file.
    holding = [write_end]

    def forked() -> None:
        # A forked child must neither hold the run open nor act as pytest on SIGTERM.
        while holding:
            with contextlib.suppress(OSError):
                os.close(holding.pop())
        if signal.getsignal(signal.SIGTERM) is _interrupt:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        with contextlib.suppress(OSError), open(forks, "a") as out:
            out.write(f"{os.getpid()} {_start_time('self')}\n")

    os.register_at_fork(after_in_child=forked)
    return run


def _interrupt(signum: int, frame: FrameType | None) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends pytest at once
    raise KeyboardInterrupt("SIGTERM")


# -- the watcher ---------------------------------------------------------------------------------


def _owned(pid: int, run: str, forks: dict[str, str]) -> bool:
    try:
        if run in _run_ids(Path(f"/proc/{pid}/environ").read_bytes()):
            return True
        return forks.get(str(pid)) == _start_time(pid)
    except (OSError, IndexError):  # gone, not ours to read, or a kernel thread
        return False


def _candidates(run: str, forks: dict[str, str]) -> Iterator[int]:
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            if _owned(int(entry.name), run, forks):
                yield int(entry.name)


def _signal(pid: int, sig: int, run: str, forks: dict[str, str]) -> bool:
    """Signal `pid` if it is still the run's: through a pidfd when the kernel has them, so a
    pid reused between the check and the signal is never hit."""
    try:
        handle: int | None = os.pidfd_open(pid)
    except ProcessLookupError:
        return False
    except (AttributeError, OSError):
        handle = None
    try:
        if not _owned(pid, run, forks):
            return False
        if handle is None:
            os.kill(pid, sig)
        else:
            signal.pidfd_send_signal(handle, sig)
        return True
    except OSError:
        return False
    finally:
        if handle is not None:
            os.close(handle)


def _command(pid: int) -> str:
    with contextlib.suppress(OSError):
        raw = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        return " ".join(raw.decode(errors="replace").split())[:120]
    return "?"


def _read_forks(run: str) -> dict[str, str]:
    """{pid: start time} of the run's forked children."""
    forks: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in _forks_file(run).read_text().splitlines():
            pid, _, start = line.partition(" ")
            forks[pid] = start
    return forks


def end_run(run: str, grace: float = GRACE) -> dict[int, str]:
    """SIGTERM the run's processes, SIGKILL any left after `grace` s; what it ended, as
    {pid: "SIGNAL: command"} (the last signal each was sent)."""
    ended: dict[int, str] = {}
    # First a moment for what ends by itself once pytest has gone (multiprocessing's
    # resource tracker ends when the last holder of its pipe does): not a leftover.
    phases: list[tuple[signal.Signals | None, float]] = [
        (None, SETTLE), (signal.SIGTERM, grace), (signal.SIGKILL, grace),
    ]  # fmt: skip
    for sig, wait in phases:
        deadline = time.monotonic() + wait
        while True:
            # Scanned again and again: a process may start another one as it ends.
            forks = _read_forks(run)
            left = list(_candidates(run, forks))
            if not left or time.monotonic() >= deadline:
                break
            for pid in left:
                # SIGTERM once each (a second one means "abort now" to our servers).
                if sig is not None and (sig == signal.SIGKILL or pid not in ended):
                    command = ended.get(pid, "").partition(": ")[2] or _command(pid)
                    if _signal(pid, sig, run, forks):
                        ended[pid] = f"{sig.name}: {command}"
            time.sleep(0.1)
        if not left:
            break
    with contextlib.suppress(OSError):
        _forks_file(run).unlink()
    return ended


def release_shared_memory(since: float, directory: Path = SHARED_MEMORY_DIR) -> list[str]:
    """Remove the shared-memory objects of `SHARED_MEMORY`'s kinds in `directory` created
    since `since` (time.time()) that no process maps; their names."""
    if not directory.is_dir():
        return []
    mapped: set[str] = set()
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError), open(f"/proc/{entry.name}/maps") as maps:
                for line in maps:
                    _, found, rest = line.partition(f"{directory}/")
                    if found:
                        mapped.add(rest.split()[0])
    removed = []
    for entry in os.scandir(directory):
        if not entry.name.startswith(SHARED_MEMORY) or entry.name in mapped:
            continue
        with contextlib.suppress(OSError):
            if entry.stat().st_mtime >= since:
                os.unlink(entry.path)
                removed.append(entry.name)
    return sorted(removed)


def _watch(run: str, read_end: int, parent: int) -> None:
    began = time.time()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    # EOF: every holder of the write end (pytest only) is gone. Reparented: pytest is gone
    # even if something it forked in a way no hook saw still holds the pipe.
    while not select.select([read_end], [], [], 1.0)[0] and os.getppid() == parent:
        pass
    ended = end_run(run)
    if ended:
        listed = "".join(f"\n  {pid} {how}" for pid, how in sorted(ended.items()))
        print(f"test run {run} is over; {LEFT_RUNNING}{listed}", file=sys.stderr)
    release_shared_memory(began)


if __name__ == "__main__":
    _watch(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
