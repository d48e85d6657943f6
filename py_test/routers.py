"""The real Rust router (SMG) and vLLM's own `--grpc` server as subprocesses, for e2e tests."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

from vllm_router.testing.wait_serving import serving

from harness import tool_path
from real_engine import ROOT, cli_flags
from vllm_servers import START_TIMEOUT, free_port, stop_process_group

ROUTER_VENV = ROOT / ".venv-router"


def smg_path() -> str | None:
    return tool_path("smg", ROUTER_VENV / "bin")


@contextlib.contextmanager
def _running(
    command: list[str], log: Path, ready: Callable[[], bool], what: str
) -> Iterator[subprocess.Popen]:
    """Run `command` (output to `log`) until the block ends; enter once `ready()` holds."""
    with open(log, "w") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            deadline = time.monotonic() + START_TIMEOUT
            while not ready():
                if process.poll() is not None:
                    raise AssertionError(f"{what} exited with {process.returncode}: see {log}")
                if time.monotonic() > deadline:
                    raise AssertionError(f"{what} not ready in {START_TIMEOUT} s: see {log}")
                time.sleep(0.5)
            yield process
        finally:
            stop_process_group(process)


def _http_models_ready(base: str) -> bool:
    try:
        with urllib.request.urlopen(base + "/v1/models", timeout=2) as response:
            return response.status == 200 and b'"data":[{' in response.read()
    except OSError:
        return False


@contextlib.contextmanager
def vllm_grpc_server(model: Path, engine_flags: dict[str, object], log: Path) -> Iterator[str]:
    """vLLM's own gRPC launcher (what `vllm serve --grpc` runs); yields its address."""
    port = free_port()
    launcher = "vllm.entrypoints.launchers.grpc_server"
    command = [sys.executable, "-m", launcher, "--model", str(model), "--host", "127.0.0.1",
               "--port", str(port), *cli_flags(engine_flags)]  # fmt: skip
    address = f"127.0.0.1:{port}"
    with _running(command, log, lambda: serving(address), "vLLM's gRPC server"):
        yield address


@contextlib.contextmanager
def smg_router(workers: list[str], model: Path, log: Path, *extra: str) -> Iterator[str]:
    """`smg launch` in front of gRPC workers; yields the router's HTTP base URL."""
    binary = smg_path()
    assert binary is not None, "the smg router is not installed (make test installs it)"
    port, metrics_port = free_port(), free_port()
    command = [binary, "launch", "--host", "127.0.0.1", "--port", str(port),
               "--worker-urls", *(f"grpc://{w}" for w in workers), "--model-path", str(model),
               "--backend", "vllm", "--prometheus-host", "127.0.0.1",
               "--prometheus-port", str(metrics_port), *extra]  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    with _running(command, log, lambda: _http_models_ready(base), "the smg router"):
        yield base


@contextlib.asynccontextmanager
async def smg_router_in_thread(
    workers: list[str], model: Path, log: Path, *extra: str
) -> AsyncIterator[str]:
    """`smg_router`, started and stopped in a thread: this event loop keeps running, so
    in-process workers (and subprocess pipes read by this loop) are served meanwhile."""
    with contextlib.ExitStack() as stack:
        router = smg_router(workers, model, log, *extra)
        base = await asyncio.to_thread(stack.enter_context, router)
        try:
            yield base
        finally:
            await asyncio.to_thread(stack.close)


def openai_post(base: str, path: str, body: dict) -> tuple[int, dict]:
    """POST to the router; (HTTP status, JSON body) whatever the status."""
    request = urllib.request.Request(
        base + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def openai_stream(base: str, path: str, body: dict) -> list[dict]:
    """POST a streaming request; the JSON of every `data:` event before [DONE]."""
    request = urllib.request.Request(
        base + path,
        data=json.dumps({**body, "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
    )
    events = []
    with urllib.request.urlopen(request, timeout=300) as response:
        for raw in response:
            line = raw.decode().strip()
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                events.append(json.loads(line[5:]))
    return events
