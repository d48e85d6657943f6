"""What the transport alone costs per streamed message: no engine, no servicer, no contract.

A bare server streams one prebuilt native-contract decode message (the bytes a plain decode
step is on the wire) to each of `--streams` open streams every `--step-ms`, as an engine's
steps would, to a grpcio client in another process that reads them all. Printed: the server
process's CPU per message (all its threads, from /proc), split into the Python threads and
the transport's own threads, and for direct sends the time inside the send call itself.

Modes (each round runs every mode once, in a fresh server process, interleaved):
- `native-direct`: pygrpc-native, each message handed to `stream_try_send` from one loop
  (what our direct sends do, without our Python around the call), `--io-threads` threads;
- `native-handler`: pygrpc-native, each stream's handler yields the message (the task path);
- `grpcio-handler`: grpc.aio's server, each stream's handler yields the message.

It bounds issue 40's ratios from below: whatever the servicer does besides, a worker on this
transport pays at least this per streamed token (benchmarks/results/transport-floor.md).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

MODES = ("native-direct", "native-handler", "grpcio-handler")


def _thread_ticks() -> dict[str, tuple[str, int]]:
    """user + system clock ticks of each of this process's threads, by thread id."""
    ticks = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/self/task/{tid}/comm") as f:
                comm = f.read().strip()
        except FileNotFoundError:  # a thread that ended meanwhile
            continue
        ticks[tid] = (comm, int(fields[11]) + int(fields[12]))
    return ticks


def _message() -> bytes:
    from vllm_router.proto import vllm_native_pb2 as npb

    output = npb.SequenceOutput(index=0, num_tokens=1)
    output.token_ids.extend([1234])
    return npb.GenerateResponse(outputs=output).SerializeToString()


async def _serve(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    import grpc

    data = _message()
    identity: Callable[[bytes], bytes] = lambda b: b  # noqa: E731 - the bytes are the message
    tick: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
    ready = asyncio.Event()
    call_ids: list[int] = []
    held: list[asyncio.Future[None]] = []

    async def by_handler(request: Any, context: Any) -> Any:
        call_ids.append(0)
        if len(call_ids) == args.streams:
            ready.set()
        while await asyncio.shield(tick):
            yield data

    async def held_open(request: Any, context: Any) -> Any:
        # The stream stays open while the driver sends into it from outside the handler.
        call_ids.append(context._call.call_id)
        if len(call_ids) == args.streams:
            ready.set()
        done = asyncio.get_running_loop().create_future()
        held.append(done)
        await done
        return
        yield

    behaviour = held_open if mode == "native-direct" else by_handler
    method = grpc.unary_stream_rpc_method_handler(
        behaviour, request_deserializer=identity, response_serializer=identity
    )
    if mode.startswith("native"):
        native = importlib.import_module("pygrpc_native.aio")
        server: Any = native.Server(None, io_threads=args.io_threads)
    else:
        server = grpc.aio.server()
    # Registered, not generic: pygrpc-native serves only registered methods in Rust.
    server.add_registered_method_handlers("vllm.Inference", {"GenerateStream": method})
    port = server.add_insecure_port("127.0.0.1:0")  # a free port, as the server picks it
    await server.start()
    client = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--client", str(port), "--streams", str(args.streams)
    )
    await asyncio.wait_for(ready.wait(), 60)
    await asyncio.sleep(0.2)
    messages = args.streams * args.steps
    in_send = 0.0
    before = _thread_ticks()
    started = time.perf_counter()
    if mode == "native-direct":
        send = server._front.stream_try_send
        for _ in range(args.steps):
            for call_id in call_ids:
                t = time.perf_counter()
                send(call_id, data)
                in_send += time.perf_counter() - t
            await asyncio.sleep(args.step_ms / 1000)
    else:
        for _ in range(args.steps):
            tick.set_result(True)
            tick = asyncio.get_running_loop().create_future()
            await asyncio.sleep(args.step_ms / 1000)
    # What was sent is on the wire (or in the kernel) once the io threads are idle again.
    await asyncio.sleep(0.3)
    after = _thread_ticks()
    wall = time.perf_counter() - started
    tick.set_result(False)
    for done in held:
        done.set_result(None)
    await asyncio.wait_for(client.wait(), 60)
    await server.stop(0)
    hz = os.sysconf("SC_CLK_TCK")
    by_comm: dict[str, int] = {}
    for tid, (comm, ticks) in after.items():
        by_comm[comm] = by_comm.get(comm, 0) + ticks - before.get(tid, (comm, 0))[1]
    main_comm = after[str(os.getpid())][0]

    def us(ticks: int) -> float:
        return ticks / hz * 1e6 / messages

    python = by_comm.pop(main_comm, 0)
    return {
        "mode": mode,
        "messages": messages,
        "wall_s": round(wall, 2),
        "total_us": us(python + sum(by_comm.values())),
        "python_us": us(python),
        "transport_us": us(sum(by_comm.values())),
        "threads_us": {comm: round(us(t), 2) for comm, t in by_comm.items() if t},
        "in_send_us": in_send * 1e6 / messages if mode == "native-direct" else None,
        "client_rc": client.returncode,
    }


def _client(port: int, streams: int) -> None:
    import grpc

    async def run() -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_stream("/vllm.Inference/GenerateStream")

            async def one() -> int:
                return sum([1 async for _ in call(b"")])

            await asyncio.gather(*(one() for _ in range(streams)))

    asyncio.run(run())


def _median(runs: list[dict[str, Any]], key: str) -> str:
    values = [run[key] for run in runs if run[key] is not None]
    return f"{statistics.median(values):.2f}" if values else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--step-ms", type=float, default=4.0)
    parser.add_argument("--io-threads", type=int, default=2, help="pygrpc-native's io_threads")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--client", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        _client(args.client, args.streams)
        return
    if args.one:
        print(json.dumps(asyncio.run(_serve(args.one, args))), flush=True)
        return
    modes = args.modes.split(",")
    results: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
    for round_ in range(args.rounds):
        for mode in modes:
            command = [sys.executable, __file__, "--one", mode, *sys.argv[1:]]
            out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
            result = json.loads(out.strip().splitlines()[-1])
            results[mode].append(result)
            print(f"round {round_ + 1} {mode}: {json.dumps(result)}", flush=True)
    print(
        f"\n{args.streams} streams, a message each every {args.step_ms} ms, {args.steps} steps; "
        f"io_threads {args.io_threads}; medians of {args.rounds} rounds, µs per message"
    )
    print("| mode | server process | Python threads | transport threads | in the send call |")
    print("|---|---|---|---|---|")
    keys = ("total_us", "python_us", "transport_us", "in_send_us")
    for mode, runs in results.items():
        print(f"| {mode} | " + " | ".join(_median(runs, key) for key in keys) + " |")


if __name__ == "__main__":
    main()
