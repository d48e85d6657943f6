"""The end of a process whose server shut down cleanly: atexit handlers, then no finalization.

After a clean shutdown ("Server stopped", everything ours closed, the engine's processes
gone), what the interpreter's finalization prints is other libraries' noise, not a fault the
operator can act on: triton's bindings (vLLM imports triton, even on CPU) are nanobind
modules, and nanobind's exit hook (`internals_cleanup` in nanobind's src/nb_internals.cpp,
registered with `Py_AtExit`, so it runs after every module has been torn down) reports the
triton objects still alive then: ~30 lines of "nanobind: leaked 4 instances! ... leaked 64
types! ... leaked 514 functions!". Triton has no switch for it.

`end_after_atexit(code)`, called once the clean shutdown is done, makes the interpreter's
exit run the atexit handlers (logging's flush, multiprocessing's, vLLM's, ...) as usual, flush
stdio, and end the process with `code` through `os._exit`, skipping the finalization after
them. Anything that goes wrong on the way out keeps the ordinary exit: an uncaught exception
(its traceback printed, `sys.last_value` set) disarms it, so its exit status and everything
finalization prints stay as they were. The process must exit with the same `code` (the CLI
passes `serve`'s return value to `sys.exit`).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import sys
import threading

_armed: int | None = None
_running = False


def end_after_atexit(code: int) -> None:
    """Arm: at interpreter exit, run the atexit handlers, flush stdio, `os._exit(code)`."""
    global _armed
    first = _armed is None
    _armed = code
    if not first:
        return
    try:
        # Called as the interpreter begins to exit, before any atexit handler runs.
        threading._register_atexit(_register_last)  # type: ignore[attr-defined]
    except (AttributeError, RuntimeError):
        _register_last()


def _register_last() -> None:
    """`_end` as the newest atexit handler, so the first called (atexit is LIFO): it calls
    the others itself, each once, and never returns to the interpreter's own loop over them."""
    atexit.register(_end)


def _failed() -> bool:
    """Whether an uncaught exception was reported (its traceback printed) on the way out."""
    return (
        getattr(sys, "last_value", None) is not None or getattr(sys, "last_exc", None) is not None
    )


def _end() -> None:
    global _running
    if _running or _armed is None or _failed():
        return
    _running = True
    code = _armed
    # The other handlers, in their usual order; ours returns at once when called again.
    atexit._run_exitfuncs()
    flush_stdio()
    os._exit(code)


def flush_stdio() -> None:
    """Python's stdout and stderr, then C's stdio buffers (what extensions printed)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            if stream is not None:
                stream.flush()
    with contextlib.suppress(Exception):
        ctypes.CDLL(None).fflush(None)
