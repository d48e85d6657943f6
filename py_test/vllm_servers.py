"""vLLM's own OpenAI server as a subprocess: the reference our outputs are compared with."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import random
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


@functools.cache
def _ephemeral_ports() -> range:
    """The kernel's range for connect() and bind(0) (Linux: ip_local_port_range)."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999  # Linux's default
    return range(low, high + 1)


_handed_out: set[int] = set()


def free_port(run: int = 1) -> int:
    """The first of `run` adjacent ports free now, for a server told its port on the command
    line. Not from the ephemeral range (what bind(0) gives): any connect() or bind(0) may take
    such a port before the server binds it, and vllm-rs binds its listener only once its engine
    is up, seconds later (a CI run lost a port that way: "Address already in use"). Not handed
    out before in this session either."""
    ephemeral = _ephemeral_ports()
    low, high = (10_000, ephemeral.start) if ephemeral.start > 20_000 else (ephemeral.stop, 65_536)
    for _ in range(500):
        port = random.randrange(low, high - run)
        ports = range(port, port + run)
        if _handed_out.intersection(ports):
            continue
        try:
            with contextlib.ExitStack() as held:
                for candidate in ports:
                    sock = held.enter_context(socket.socket())
                    sock.bind(("127.0.0.1", candidate))
        except OSError:
            continue
        _handed_out.update(ports)
        return port
    raise AssertionError(f"no {run} adjacent free port(s) in {low}-{high}")


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
    model: Path,
    engine_flags: dict[str, object],
    *extra: str,
    log_name: str,
    environment: dict[str, str] | None = None,
) -> Iterator[str]:
    """Start `python -m vllm.entrypoints.openai.api_server` (with `environment` added to
    this process's); yield its base URL once healthy."""
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
            env={**os.environ, **(environment or {})},
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
