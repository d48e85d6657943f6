"""Garbage-collector pauses of a vllm-servicer process, each full collection as it happens.

Put this directory first on PYTHONPATH of the server (Python imports `sitecustomize` at
start): every full (oldest-generation) collection then prints one line to stderr, and
every 10 s a line with the totals per generation, e.g.

    PYTHONPATH=benchmarks/gc_probe bench.py --targets ours-native@native ...

and read the lines from the target's log. A full collection runs on whichever thread
allocates when it is due: in a servicer, the event loop, so no stream gets a token for
as long as it takes.
"""

from __future__ import annotations

import gc
import os
import sys
import threading
import time
from typing import Any

if "vllm-servicer" in " ".join(sys.argv):
    _seconds = [0.0, 0.0, 0.0]
    _counts = [0, 0, 0]
    _started = [0.0]

    def _on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            _started[0] = time.perf_counter()
            return
        generation = info["generation"]
        took = time.perf_counter() - _started[0]
        _seconds[generation] += took
        _counts[generation] += 1
        if generation == 2:
            print(
                f"GC full collection: {took * 1000:.1f} ms, {info['collected']} collected, "
                f"{gc.get_freeze_count()} frozen, process CPU {time.process_time():.1f} s",
                file=sys.stderr,
                flush=True,
            )

    def _totals() -> None:
        while True:
            time.sleep(10)
            print(
                f"GC totals pid {os.getpid()}: seconds {[round(s, 3) for s in _seconds]} "
                f"collections {_counts} process CPU {time.process_time():.1f} s",
                file=sys.stderr,
                flush=True,
            )

    gc.callbacks.append(_on_gc)
    threading.Thread(target=_totals, daemon=True, name="gc-probe").start()
