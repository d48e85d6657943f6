"""What a write that wakes another process costs the writer, against one that wakes nobody.

The servicer's costliest single operations are wakes: vLLM's engine-core send wakes ZMQ's io
thread once per request, and every transport send may wake tokio's io thread. On a VM a
plain syscall is cheap, but a write whose reader sleeps makes the kernel wake another vCPU.
This prints both, in µs of the writer's wall time per write:

    python benchmarks/wake_cost.py [--writes 5000]

The reader is a forked process blocked in `read`, acknowledging each byte, so the writer's
`write` is timed alone and the reader is asleep again before the next one.
"""

from __future__ import annotations

import argparse
import os
import time


def _reader(source: int, ack: int) -> None:
    while True:
        byte = os.read(source, 1)
        if not byte or byte == b"q":
            os._exit(0)
        os.write(ack, b"k")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--writes", type=int, default=5000)
    writes = parser.parse_args().writes

    source_r, source_w = os.pipe()
    ack_r, ack_w = os.pipe()
    if os.fork() == 0:
        os.close(source_w)
        os.close(ack_r)
        _reader(source_r, ack_w)
    os.close(source_r)
    os.close(ack_w)

    waking = 0.0
    for _ in range(writes):
        time.sleep(0.0002)  # the reader blocks in read again
        started = time.perf_counter()
        os.write(source_w, b"x")
        waking += time.perf_counter() - started
        os.read(ack_r, 1)
    os.write(source_w, b"q")
    os.wait()

    idle_r, idle_w = os.pipe()
    started = time.perf_counter()
    for written in range(writes):
        os.write(idle_w, b"x")
        if written % 4096 == 4095:
            os.read(idle_r, 4096)  # keep the pipe from filling
    plain = time.perf_counter() - started
    os.close(idle_r)
    os.close(idle_w)
    os.close(source_w)
    os.close(ack_r)

    print(f"a write that wakes a sleeping reader: {waking / writes * 1e6:.2f} µs")
    print(f"a write that wakes nobody:            {plain / writes * 1e6:.2f} µs")


if __name__ == "__main__":
    main()
