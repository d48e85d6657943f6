"""vLLM's own OpenAI server as a subprocess: the reference our outputs are compared with."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from real_engine import cli_flags

START_TIMEOUT = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VllmHttpError(AssertionError):
    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"vLLM answered {status}: {body[:500]!r}")
        self.status = status
        self.body = body


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    """POST JSON; an HTTP error raises VllmHttpError (an AssertionError) with its body."""
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        raise VllmHttpError(exc.code, exc.read()) from exc


@contextlib.contextmanager
def vllm_openai_server(
    model: Path, engine_flags: dict[str, object], *extra: str, log_name: str
) -> Iterator[str]:
    """Start `python -m vllm.entrypoints.openai.api_server`; yield its base URL."""
    port = free_port()
    log_path = model.parent / log_name
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model",
                str(model),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                *cli_flags(engine_flags),
                *extra,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: see stop_process_group
        )
        base = f"http://127.0.0.1:{port}"
        try:
            _wait_healthy(process, base, log_path)
            yield base
        finally:
            stop_process_group(process)


def stop_process_group(process: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL the whole process group (vLLM's engine processes included)."""
    process.terminate()
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)


def _wait_healthy(process: subprocess.Popen, base: str, log_path: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        if process.poll() is not None:
            raise AssertionError(f"vLLM's server exited: see {log_path}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"vLLM's server did not start in {START_TIMEOUT} s: {log_path}")
        time.sleep(1)
