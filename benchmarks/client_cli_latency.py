"""Wall time of one `vllm-servicer-client` call against a warm worker, per command.

    python benchmarks/client_cli_latency.py --tokenizer-dir .cache/tiny-llama [--client CMD]

The worker (a subprocess) is the mock engine serving DIR's tokenizer files
(vllm_router.testing.mock_tokenizer), so the text and --chat paths fetch, cache and load a
real tokenizer while the engine costs nothing: what is measured is the CLI's own start-up,
imports, tokenizer load and RPCs. `--client` is a command to time (default: the
`vllm-servicer-client` beside this Python); give it more than once (another venv's, or
`"env PYTHONPATH=OTHER/py_src PY -c 'from vllm_router.client_cli import main; main()'"`)
to compare installs or versions, their runs interleaved so that a busy machine weighs on
each alike. Each client has a fresh tokenizer cache: its first text call (fetch + store)
is reported on its own, then every command runs --runs times and the median is printed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from vllm_router.testing.wait_serving import serving

MAX_TOKENS = "8"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def serve(tokenizer_dir: str, port: int, vocab_size: int) -> None:
    """The worker: run in its own process (`--serve`), as a deployed worker would be."""
    from vllm_router.server import ServerConfig
    from vllm_router.server import serve as serve_engine
    from vllm_router.testing.mock_config import MockConfig
    from vllm_router.testing.mock_tokenizer import MockEngineWithTokenizer

    engine = MockEngineWithTokenizer(tokenizer_dir, MockConfig(vocab_size=vocab_size))
    sys.exit(asyncio.run(serve_engine(engine, ServerConfig(port=port))))


def cases(client: list[str], address: str) -> dict[str, list[str]]:
    base = [*client, "--address", address]
    generate = [*base, "generate", "--max-tokens", MAX_TOKENS, "--ignore-eos"]
    return {
        "--help": [*client, "--help"],
        "info": [*base, "info"],
        "health": [*base, "health"],
        "loads": [*base, "loads"],
        "generate --token-ids": [*generate, "--token-ids", "10,11,12"],
        "generate TEXT": [*generate, "Good servers drain in-flight work"],
        "generate --chat TEXT": [*generate, "--chat", "What is the capital of France?"],
    }


def timed(command: list[str], env: dict[str, str]) -> float:
    started = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    elapsed = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{shlex.join(command)} failed ({done.returncode}): {done.stderr.strip()}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer-dir", type=Path, required=True)
    parser.add_argument("--client", action="append", help="a command to time (repeatable)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--vocab-size", type=int, default=65536, help="the mock's vocab_size")
    parser.add_argument("--serve", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(str(args.tokenizer_dir), args.serve, args.vocab_size)
    port = free_port()
    address = f"127.0.0.1:{port}"
    server = subprocess.Popen(
        [sys.executable, __file__, "--tokenizer-dir", str(args.tokenizer_dir),
         "--vocab-size", str(args.vocab_size), "--serve", str(port)],
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not serving(address):
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the mock worker did not start")
            time.sleep(0.2)
        clients = args.client or [str(Path(sys.executable).parent / "vllm-servicer-client")]
        with tempfile.TemporaryDirectory() as caches:
            runs: dict[str, dict[str, list[float]]] = {}
            envs = {
                client: {**os.environ, "VLLM_SERVICER_TOKENIZER_CACHE": f"{caches}/{i}"}
                for i, client in enumerate(clients)
            }
            plans = {client: cases(shlex.split(client), address) for client in clients}
            first = "first text call (GetTokenizer, cache store)"
            for client in clients:
                text = plans[client]["generate TEXT"]
                runs.setdefault(first, {})[client] = [timed(text, envs[client])]
            for name in plans[clients[0]]:
                for _ in range(args.runs):
                    for client in clients:
                        times = runs.setdefault(name, {}).setdefault(client, [])
                        times.append(timed(plans[client][name], envs[client]))
        print(f"tokenizer {args.tokenizer_dir}, median of {args.runs} runs (each run's seconds)")
        for i, client in enumerate(clients):
            print(f"[{i}] {client}")
        for name, by_client in runs.items():
            cells = [
                f"[{i}] {statistics.median(by_client[c]):5.2f} s "
                f"({' '.join(f'{t:.2f}' for t in by_client[c])})"
                for i, c in enumerate(clients)
            ]
            print(f"{name:44s} " + "   ".join(cells))
    finally:
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
