"""Shared fixtures: an in-process server on the mock engine, reachable over a real channel."""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import pytest_asyncio

from vllm_router.mock_engine import MockAsyncEngine
from vllm_router.proto import vllm_engine_pb2 as pb
from vllm_router.proto import vllm_engine_pb2_grpc as pb_grpc
from vllm_router.server import RunningServer, ServerConfig, start_server

# `make test` sets this: a test that cannot run (no vLLM, no grpcurl) fails, not skips.
REQUIRE_ALL = os.environ.get("VLLM_SERVICER_REQUIRE_ALL") == "1"


_FIGURES: list[str] = []


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


def require(condition: bool, reason: str) -> None:
    """Skip when a prerequisite is missing, except under `make test`/CI, where it fails."""
    if not condition:
        if REQUIRE_ALL:
            pytest.fail(f"prerequisite missing (VLLM_SERVICER_REQUIRE_ALL=1): {reason}")
        pytest.skip(reason)


def grpcurl_path() -> str | None:
    beside_python = Path(sys.executable).parent / "grpcurl"
    return str(beside_python) if beside_python.exists() else shutil.which("grpcurl")


@dataclass
class Harness:
    engine: MockAsyncEngine
    server: RunningServer
    channel: grpc.aio.Channel
    stub: pb_grpc.VllmEngineStub

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server.port}"


StartServer = Callable[..., Awaitable[Harness]]


@pytest_asyncio.fixture
async def start_mock() -> AsyncIterator[StartServer]:
    """Factory: start a mock-engine server with the given engine/server settings."""
    started: list[Harness] = []

    async def _start(config: ServerConfig | None = None, **engine_kwargs: object) -> Harness:
        engine = MockAsyncEngine(**engine_kwargs)  # type: ignore[arg-type]
        config = config or ServerConfig(port=0, shutdown_grace_seconds=2.0)
        running = await start_server(engine, config)
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{running.port}")
        harness = Harness(engine, running, channel, pb_grpc.VllmEngineStub(channel))
        started.append(harness)
        return harness

    yield _start
    for harness in started:
        await harness.channel.close()
        await harness.server.drain_and_stop()


@pytest_asyncio.fixture
async def mock(start_mock: StartServer) -> Harness:
    """A mock server with a short step delay, so requests stay in flight a moment."""
    return await start_mock(step_delay=0.001)


def request(
    prompt: list[int] | None = None, request_id: str = "", **sampling: object
) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=request_id,
        prompt_token_ids=prompt or [],
        sampling_params=pb.SamplingParams(**sampling),  # type: ignore[arg-type]
    )


async def wait_until(predicate: Callable[[], bool], timeout: float = 10.0, what: str = "") -> None:
    """Poll `predicate` until it holds; fail with `what` after `timeout` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        assert loop.time() < deadline, f"not reached in {timeout}s: {what or predicate}"
        await asyncio.sleep(0.02)


def real_engine_idle(harness: RealHarness) -> bool:
    """The engine's own view (not the servicer's): nothing unfinished, scheduler empty."""
    load = harness.engine.load()
    unfinished = harness.engine.llm.get_num_unfinished_requests()
    return unfinished == 0 and load.running_requests == 0 and load.waiting_requests == 0


async def collect_stream(
    stub: pb_grpc.VllmEngineStub, req: pb.GenerateRequest, **kwargs: object
) -> list[pb.GenerateStreamResponse]:
    return [message async for message in stub.GenerateStream(req, **kwargs)]


async def read_rest(call: grpc.aio.UnaryStreamCall) -> list[pb.GenerateStreamResponse]:
    """Read a stream to its end after earlier `read()` calls (iteration cannot be mixed in)."""
    messages = []
    while (message := await call.read()) is not grpc.aio.EOF:
        messages.append(message)
    return messages


@dataclass
class RealHarness:
    engine: object  # vllm_router.vllm_engine.VllmEngine
    server: RunningServer
    channel: grpc.aio.Channel
    stub: pb_grpc.VllmEngineStub
    model_dir: Path


async def _real_harness(temperature: float | None = None) -> AsyncIterator[RealHarness]:
    import real_engine

    real_engine.require_vllm()
    model_dir = real_engine.tiny_model(temperature)
    engine = real_engine.start_engine(model_dir)
    running = await start_server(engine, ServerConfig(port=0, shutdown_grace_seconds=5.0))
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{running.port}")
    try:
        yield RealHarness(engine, running, channel, pb_grpc.VllmEngineStub(channel), model_dir)
    finally:
        await channel.close()
        await running.drain_and_stop()  # also shuts the engine down


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def real() -> AsyncIterator[RealHarness]:
    """Our server over a real vLLM AsyncLLM on the tiny model, one per test session."""
    async for harness in _real_harness():
        yield harness


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def real_with_generation_defaults() -> AsyncIterator[RealHarness]:
    """A second engine whose checkpoint's generation_config.json sets temperature 0.05."""
    async for harness in _real_harness(temperature=0.05):
        yield harness
