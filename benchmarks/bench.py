"""Benchmark harness: ours vs vLLM's HTTP server vs vLLM's own --grpc launcher vs the
engine alone, on the same model and engine flags. `make bench` runs it.

Each target is started, measured at every concurrency level, and stopped; the client
runs in this process (uvloop). Output: a markdown table (ratios to `engine` at the
same level), JSON lines and a PNG plot in benchmarks/runs/ (not tracked; curated results
worth keeping go to benchmarks/results/ with their command and machine).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import clients
import timeline
from procstat import CpuWindow, rss_mb
from report import write_results
from workload import Workload, add_cpu, summarize

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
BIN = Path(sys.executable).parent
ENGINE_FLAGS = ["--gpu-memory-utilization", "0.3", "--enforce-eager"]
TARGETS = (
    "engine",
    "ours",
    "ours-batched",
    "ours-compact",
    "ours-vllm-outputs",
    "ours-si4",
    "ours-metrics",
    "vllm-grpc",
    "vllm-grpc-si4",
    "vllm-http",
    "smg-rust",
    "vllm-rs",
    "router-ours",
    "router-vllm-grpc",
    "router-smg-rust",
    "ours-native",
    "vllm-rs-grpc",
    "vllm-router-ours",
    "vllm-router-vllm-rs",
    "ours-mock",
    "ours-mock-compact",
    "grpc-floor",
    "ours-vllm-grpc",
)
# A target of ours (served by vllm-servicer) named with one of these suffixes is the same
# server, client and router with only the transport changed: `ours@native` is `ours` on
# --transport native (pygrpc-native: HTTP/2 in Rust; a stream's plain decode steps sent
# from the engine's output loop), `ours@native-queued` the same with --no-direct-sends
# (every message from the handler). Run when asked for (--targets): the transport is opt-in.
TRANSPORT_VARIANTS = {
    "@native": ["--transport", "native"],
    "@native-queued": ["--transport", "native", "--no-direct-sends"],
}
# Router targets: a Rust router (OpenAI streaming chat) in front of a worker target: SMG
# (vllm.grpc.engine) or vllm-router (vLLM's native vllm.Inference).
ROUTED = {
    "router-ours": "ours",
    "router-vllm-grpc": "vllm-grpc",
    "router-smg-rust": "smg-rust",
    "vllm-router-ours": "ours",
    "vllm-router-vllm-rs": "vllm-rs-grpc",
}
VLLM_ROUTER = ("vllm-router-ours", "vllm-router-vllm-rs")
# Targets served by another target's server, with a different request.
SAME_SERVER = {
    **ROUTED,
    "ours-si4": "ours",
    "ours-batched": "ours",
    "ours-compact": "ours",
    "ours-native": "ours",
    "ours-vllm-grpc": "ours",
    "ours-mock-compact": "ours-mock",
}
# Stream interval 4: ours per request (SamplingParams.stream_interval), vLLM's --grpc
# launcher engine-wide (--stream-interval 4: it has no per-request field).
STREAM_INTERVAL = {"ours-si4": 4, "vllm-grpc-si4": 4}
CLIENT = {
    "ours": clients.ours,
    "ours-si4": clients.ours,
    "ours-batched": clients.ours_batched,
    "ours-compact": clients.ours_compact,
    "ours-mock-compact": clients.ours_compact,
    "ours-vllm-outputs": clients.ours,
    "ours-metrics": clients.ours,
    "ours-mock": clients.ours,
    "grpc-floor": clients.ours,
    "vllm-grpc": clients.vllm_grpc,
    "ours-vllm-grpc": clients.vllm_grpc,
    "vllm-grpc-si4": clients.vllm_grpc,
    "vllm-http": clients.vllm_http,
    "smg-rust": clients.vllm_grpc,
    "vllm-rs": clients.vllm_http,
    "router-ours": clients.openai_chat,
    "router-vllm-grpc": clients.openai_chat,
    "router-smg-rust": clients.openai_chat,
    "ours-native": clients.native,
    "vllm-rs-grpc": clients.native,
    "vllm-router-ours": clients.openai_chat,
    "vllm-router-vllm-rs": clients.openai_chat,
}
SMG = ROOT / ".venv-router" / "bin" / "smg"
VLLM_ROUTER_BIN = ROOT / ".venv-vllm-router" / "bin" / "vllm-router"
# The Rust anchors' pieces (make bench fetches them; see the Makefile).
BENCH_DIR = ROOT / ".cache" / "bench"
VLLM_RS_DIR = ROOT / ".cache" / "vllm-rs"  # installed by make test (and make bench)
VLLM_RS = VLLM_RS_DIR / "vllm-rs"
# Extra environment per target: the Rust anchors' pieces are importable by them alone.
TARGET_ENV = {
    "smg-rust": {"PYTHONPATH": str(BENCH_DIR / "smg"), "SMG_VLLM_SERVICER_WARMUP": "off"},
    "vllm-grpc": {"SMG_VLLM_SERVICER_WARMUP": "off"},
    "vllm-grpc-si4": {"SMG_VLLM_SERVICER_WARMUP": "off"},
    "vllm-rs": {
        "PYTHONPATH": str(VLLM_RS_DIR / "vllm-meta"),
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_RUST_FRONTEND_PATH": str(VLLM_RS),
    },
}
TARGET_ENV["vllm-rs-grpc"] = TARGET_ENV["vllm-rs"]
# Targets answering OpenAI HTTP (ready when /health answers 200).
HTTP_TARGETS = ("vllm-http", "vllm-rs")


def warm_up(workload: Workload) -> Workload:
    """Waves at the measured concurrency (the engine's first large batches are slow): two
    for short outputs, one for long ones."""
    waves = 2 if workload.output_len <= 64 else 1
    return dataclasses.replace(workload, requests=waves * workload.concurrency)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def split_target(target: str) -> tuple[str, str]:
    """A target's base name and its transport suffix ("" for none)."""
    base, at, variant = target.partition("@")
    return base, at + variant


def ours(target: str) -> bool:
    """Whether `target` is served by vllm-servicer (what a transport variant changes)."""
    base = split_target(target)[0]
    return SAME_SERVER.get(base, base) in ("ours", "ours-metrics", "ours-vllm-outputs", "ours-mock")


def report_order(targets: list[str]) -> tuple[str, ...]:
    """TARGETS' order, each transport variant right after its base target."""
    variants = ["", *TRANSPORT_VARIANTS]
    return tuple(t + v for t in TARGETS for v in variants if t + v in targets or not v)


def command(target: str, model: str, port: int, max_model_len: int) -> list[str]:
    target, variant = split_target(target)
    if variant:
        return [*command(target, model, port, max_model_len), *TRANSPORT_VARIANTS[variant]]
    flags = ["--model", model, "--max-model-len", str(max_model_len), *ENGINE_FLAGS]
    py = sys.executable
    return {
        "ours": [str(BIN / "vllm-servicer"), "--port", str(port), *flags],
        "ours-metrics": [str(BIN / "vllm-servicer"), "--port", str(port), "--metrics-port", "0",
                         *flags],
        "ours-vllm-outputs": [str(BIN / "vllm-servicer"), "--port", str(port),
                              "--no-lean-outputs", *flags],
        "vllm-grpc": [py, "-m", "vllm.entrypoints.launchers.grpc_server", "--host", "127.0.0.1",
                      "--port", str(port), *flags],
        "vllm-grpc-si4": [py, "-m", "vllm.entrypoints.launchers.grpc_server", "--host",
                          "127.0.0.1", "--port", str(port), "--stream-interval", "4", *flags],
        "vllm-http": [py, "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1",
                      "--port", str(port), *flags],
        "ours-mock": [str(BIN / "vllm-servicer"), "--mock-engine", "--port", str(port),
                      "--mock-vocab-size", "512", "--mock-max-model-len", str(max_model_len)],
        "grpc-floor": [py, str(HERE / "grpc_floor.py"), "--port", str(port)],
        "smg-rust": [py, str(HERE / "smg_rust_servicer.py"), "--host", "127.0.0.1",
                     "--port", str(port), *flags],
        "vllm-rs": [str(VLLM_RS), "serve", model, "--python", py, "--host", "127.0.0.1",
                    "--port", str(port), "--max-model-len", str(max_model_len), "--",
                    *ENGINE_FLAGS],
        # Its gRPC services on `port`; its HTTP server on another port (unused).
        "vllm-rs-grpc": [str(VLLM_RS), "serve", model, "--python", py, "--host", "127.0.0.1",
                         "--port", str(free_port()), "--grpc-port", str(port),
                         "--max-model-len", str(max_model_len), "--", *ENGINE_FLAGS],
    }[target]  # fmt: skip


async def wait_ready(target: str, address: str, process: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{target} exited with {process.returncode} before it was ready")
        try:
            if target in HTTP_TARGETS:
                if await asyncio.to_thread(_http_ok, f"http://{address}/health"):
                    return
            else:
                async with grpc_channel(address) as channel:
                    await asyncio.wait_for(channel.channel_ready(), 2)
                    if target in ("grpc-floor", "vllm-grpc", "vllm-grpc-si4"):
                        return
                    from grpc_health.v1 import health_pb2, health_pb2_grpc

                    reply = await health_pb2_grpc.HealthStub(channel).Check(
                        health_pb2.HealthCheckRequest(), timeout=2
                    )
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
        except Exception:
            pass
        await asyncio.sleep(1)
    raise RuntimeError(f"{target} not ready after {timeout:.0f}s")


def _http_ok(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=2) as response:
        return response.status == 200


def _spawn(
    target: str, args: argparse.Namespace, port: int, marks: Path | None = None
) -> subprocess.Popen:
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
           **TARGET_ENV.get(target, {})}  # fmt: skip
    if marks is not None:  # --timeline: its processes (engine core included) record marks
        marks.mkdir(parents=True)
        env["BENCH_TIMELINE_DIR"] = str(marks)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(timeline.PROBE), env.get("PYTHONPATH")) if p
        )
    with open(args.out / f"{target}.log", "w") as log:
        return subprocess.Popen(
            command(target, args.model, port, args.max_model_len), stdout=log, stderr=log, env=env
        )


def grpc_channel(address: str):
    import grpc

    return grpc.aio.insecure_channel(address)


async def _spawn_router(
    args: argparse.Namespace, worker: str, target: str
) -> tuple[subprocess.Popen, str]:
    port = free_port()
    if target in VLLM_ROUTER:
        command = [str(VLLM_ROUTER_BIN), "--host", "127.0.0.1", "--port", str(port),
                   "--worker-urls", f"grpc://{worker}", "--policy", "round_robin",
                   "--disable-circuit-breaker", "--disable-retries",
                   "--prometheus-port", str(free_port())]  # fmt: skip
        env = {**os.environ, "VLLM_ROUTER_TOKENIZER": args.model}
    else:
        command = [str(SMG), "launch", "--host", "127.0.0.1", "--port", str(port),
                   "--worker-urls", f"grpc://{worker}", "--model-path", args.model,
                   "--backend", "vllm", "--prometheus-host", "127.0.0.1",
                   "--prometheus-port", str(free_port())]  # fmt: skip
        env = None
    process = _start_logged(command, args.out / "router.log", env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the router exited with {process.returncode}: see router.log")
        with contextlib.suppress(Exception):
            if b'"data":[{' in await asyncio.to_thread(_http_body, base + "/v1/models"):
                return process, base
        await asyncio.sleep(1)
    process.kill()
    raise RuntimeError("the router was not ready after 120s")


def _start_logged(
    command: list[str], log_path: Path, env: dict[str, str] | None = None
) -> subprocess.Popen:
    with open(log_path, "w") as log:
        return subprocess.Popen(command, stdout=log, stderr=log, env=env)


def _http_body(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=2) as response:
        return response.read()


async def measure_server(
    target: str, args: argparse.Namespace, levels: list[Workload]
) -> list[dict]:
    port = free_port()
    address = f"127.0.0.1:{port}"
    base, variant = split_target(target)
    worker = SAME_SERVER.get(base, base) + variant
    marks = args.out / "timeline" / f"{target}-{time.monotonic_ns()}" if args.timeline else None
    process = _spawn(worker, args, port, marks)
    router: subprocess.Popen | None = None
    try:
        await wait_ready(worker, address, process, timeout=300)
        if base in ROUTED:
            router, address = await _spawn_router(args, address, base)
        results = []
        for workload in levels:
            if base == "ours-si4":
                workload = dataclasses.replace(workload, stream_interval=4)
            url = f"http://{address}" if base in HTTP_TARGETS else address
            close, one = CLIENT[base](url, workload)
            # Front-end CPU: the worker's own process (not its engine-core child); and
            # the router's, for the router targets.
            cpu = CpuWindow(process.pid, *([router.pid] if router is not None else []))
            try:
                await clients.drive(warm_up(workload), one)
                cpu.start()
                records, wall = await clients.drive(workload, one)
                seconds = cpu.stop()
            finally:
                await close()
            result = summarize(target, workload, records, wall)
            if marks is not None:
                await asyncio.sleep(1.5)  # the probe writes its marks every 0.5 s
                result["timeline"] = timeline.per_request(records, timeline.read_marks(marks))
            add_cpu(result, seconds[0], rss_mb(process.pid))
            result["stream_interval"] = STREAM_INTERVAL.get(base, 1)
            if router is not None:
                result["router_cpu_us_per_token"] = result["cpu_us_per_token"] * (
                    seconds[1] / seconds[0] if seconds[0] else float("nan")
                )
            # What each server does with text: vLLM's gRPC launcher never detokenizes,
            # its HTTP server always does; ours and the engine do as the workload asks.
            # Through the router: it detokenizes; the workers send token ids.
            result["text"] = {
                "vllm-grpc": False,
                "smg-rust": False,
                "ours-native": False,
                "ours-vllm-grpc": False,
                "vllm-rs-grpc": False,
                "vllm-http": True,
                "vllm-rs": True,
            }.get(base, True if base in ROUTED else not workload.skip_detokenize)
            print(json.dumps(result), flush=True)
            results.append(result)
        return results
    finally:
        if router is not None:
            router.terminate()
            router.wait(30)
        process.terminate()
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()


def measure_engine(args: argparse.Namespace, levels: list[Workload]) -> list[dict]:
    spec = json.dumps([w.__dict__ for w in levels])
    out = subprocess.run(
        [sys.executable, str(HERE / "engine_direct.py"), "--model", args.model,
         "--max-model-len", str(args.max_model_len), "--levels", spec],
        capture_output=True, text=True, cwd=HERE, timeout=1800,
        env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")},
    )  # fmt: skip
    (args.out / "engine.log").write_text(out.stdout + out.stderr)
    results = [
        json.loads(line[7:]) for line in out.stdout.splitlines() if line.startswith("RESULT ")
    ]
    if len(results) != len(levels):
        raise RuntimeError(f"engine run failed: see {args.out / 'engine.log'}")
    for result in results:
        print(json.dumps(result), flush=True)
    return results


async def run(args: argparse.Namespace) -> None:
    levels = [
        Workload(
            requests=max(
                args.min_requests,
                c * (args.requests_per_slot if output_len <= 64 else args.long_requests_per_slot),
            ),
            concurrency=c,
            prompt_len=args.prompt_len,
            output_len=output_len,
            sampled=args.sampled,
            skip_detokenize=not args.detokenize,
        )
        for output_len in args.output_lens
        for c in args.concurrency
    ]
    results: list[dict] = []
    for round_ in range(args.rounds):
        # Each round starts one target later: no target always runs right after another.
        shift = round_ % len(args.targets)
        for target in args.targets[shift:] + args.targets[:shift]:
            print(f"== {target} (round {round_ + 1} of {args.rounds})", flush=True)
            if target == "engine":
                measured = measure_engine(args, levels)
            else:
                measured = await measure_server(target, args, levels)
            results += [{**result, "round": round_} for result in measured]
    write_results(results, args.out, report_order(args.targets))
    if args.timeline:
        rounds: dict[str, list[dict[str, float]]] = {}
        for result in results:
            if "timeline" in result:
                rounds.setdefault(result["target"], []).append(result["timeline"])
        text = timeline.table(rounds)
        (args.out / "timeline.md").write_text(text + "\n")
        print("\nFirst-token timeline (ms after the client's send; medians):\n" + text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model dir (default: the built-in tiny model)")
    parser.add_argument(
        "--targets",
        default=",".join(TARGETS),
        help=f"comma-separated, of: {', '.join(TARGETS)} (default: all); a target of ours "
        f"with {' or '.join(TRANSPORT_VARIANTS)} after its name: the same on another transport",
    )
    parser.add_argument("--concurrency", default="1,16,64,256")
    parser.add_argument("--output-lens", default="64,400", help="one run of every level per length")
    parser.add_argument("--requests-per-slot", type=int, default=4)
    parser.add_argument(
        "--long-requests-per-slot", type=int, default=1, help="for output lengths above 64"
    )
    parser.add_argument("--min-requests", type=int, default=16)
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every target this many times, interleaved; the report shows medians",
    )
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--sampled", action="store_true", help="temperature 0.8 instead of greedy")
    parser.add_argument(
        "--detokenize",
        action="store_true",
        help="ask ours/engine for text too (default: token ids only, as a router that "
        "detokenizes itself would, and as vLLM's --grpc launcher always does)",
    )
    parser.add_argument("--out", type=Path, default=HERE / "runs")
    parser.add_argument(
        "--timeline",
        action="store_true",
        help="the first token's timeline per target, stage by stage (front end and engine "
        "core marks on one clock; see timeline.py): at concurrency 1 only",
    )
    args = parser.parse_args()
    args.targets = [t for t in args.targets.split(",") if t]
    unknown = {
        t
        for t in args.targets
        if split_target(t)[0] not in TARGETS
        or (split_target(t)[1] and (split_target(t)[1] not in TRANSPORT_VARIANTS or not ours(t)))
    }
    if unknown:
        parser.error(f"unknown targets {sorted(unknown)}; choose from {', '.join(TARGETS)}")
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    if args.timeline:
        args.concurrency = [1]  # a mark belongs to the one request in flight
    args.output_lens = [int(n) for n in args.output_lens.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.model:
        from vllm_router.testing.tiny_model import build_tiny_model

        args.model = str(build_tiny_model(ROOT / ".cache" / "tiny-llama"))
    with contextlib.suppress(ImportError):
        import uvloop

        uvloop.install()
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
