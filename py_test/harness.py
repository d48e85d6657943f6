"""Test library: one request builder, one server harness and the helpers every suite uses.

Fixtures live in conftest.py; this module is what tests import.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import sys
import urllib.request
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from vllm_router.engine import AsyncEngine
from vllm_router.proto import vllm_engine_pb2 as pb
from vllm_router.proto import vllm_engine_pb2_grpc as pb_grpc
from vllm_router.server import RunningServer, ServerConfig, start_server

# `make test` sets this: a test that cannot run (no vLLM, no grpcurl) fails, not skips.
REQUIRE_ALL = os.environ.get("VLLM_SERVICER_REQUIRE_ALL") == "1"
# The transport the suite's servers use (ServerConfig.transport); test_transport.py runs the
# mock-engine suite again with VLLM_SERVICER_TRANSPORT=native.
TRANSPORT = os.environ.get("VLLM_SERVICER_TRANSPORT", "grpcio")
NATIVE_TRANSPORT = TRANSPORT == "native"


def require(condition: bool, reason: str) -> None:
    """Skip when a prerequisite is missing, except under `make test`/CI, where it fails."""
    if not condition:
        if REQUIRE_ALL:
            pytest.fail(f"prerequisite missing (VLLM_SERVICER_REQUIRE_ALL=1): {reason}")
        pytest.skip(reason)


def tool_path(name: str, directory: Path | None = None) -> str | None:
    """An installed command: in `directory` (default: beside this Python), else on PATH."""
    beside = (directory or Path(sys.executable).parent) / name
    return str(beside) if beside.exists() else shutil.which(name)


def grpcurl_path() -> str | None:
    return tool_path("grpcurl")


@dataclass
class Harness:
    """A started server around `engine`, and a channel and stub to reach it."""

    engine: Any  # MockAsyncEngine or VllmEngine: tests use each one's extras
    server: RunningServer
    channel: grpc.aio.Channel
    stub: pb_grpc.VllmEngineStub
    model_dir: Path | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    @property
    def metrics_url(self) -> str:
        endpoint = self.server.metrics_endpoint
        assert endpoint is not None, "started without metrics_port"
        return endpoint.url

    async def close(self) -> None:
        await self.channel.close()
        await self.server.drain_and_stop()  # also shuts the engine down


class Borrowed:
    """An engine lent to a second server (another transport over the session's engine):
    everything passes through but `shutdown`, which stays with the engine's owner."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def shutdown(self) -> None:
        pass


def without_load(message: Any) -> Any:
    """`message` without the worker's load it may carry (GenerateStream's first and last
    messages: it differs run to run), kept as whether it is there."""
    if "metrics" in message.DESCRIPTOR.fields_by_name and message.HasField("metrics"):
        message.metrics.Clear()
        message.metrics.SetInParent()
    return message


class DirectCount:
    """How many plain decode steps this process's flights sent directly, how many were
    refused, and how many of those refusals came once direct sends had begun (the transport
    refusing a full window; before a stream's first message every step is refused). The
    `direct_count` fixture counts them. How many of each a stream gets is the machine's
    speed; that the window filled and direct sends resumed after it is not."""

    def __init__(self) -> None:
        self.sent = 0
        self.refused = 0
        self.refused_once_sending = 0
        # Refused with nothing to render the step with (the flight had not rendered the
        # request's first step): the direct-step rule's fault, never the transport's.
        self.unrendered = 0


# The start_mock fixture's factory: (ServerConfig | None, **MockConfig fields) -> Harness.
StartServer = Callable[..., Awaitable[Harness]]


def with_transport(config: ServerConfig) -> ServerConfig:
    """`config` on the suite's transport (TRANSPORT), unless it names another than the
    default (test_transport.py, which runs both, is not run under VLLM_SERVICER_TRANSPORT)."""
    if config.transport != ServerConfig.transport:
        return config
    return dataclasses.replace(config, transport=TRANSPORT)


class Bearer(
    grpc.aio.UnaryUnaryClientInterceptor,
    grpc.aio.UnaryStreamClientInterceptor,
    grpc.aio.StreamUnaryClientInterceptor,
    grpc.aio.StreamStreamClientInterceptor,
):  # type: ignore[misc]
    """Sends `authorization: Bearer <key>` with every call of a channel that names none."""

    def __init__(self, key: str) -> None:
        self._header = ("authorization", f"Bearer {key}")

    def _with_key(self, details: Any) -> Any:
        metadata = tuple(details.metadata or ())
        if any(name == "authorization" for name, _ in metadata):
            return details
        return details._replace(metadata=(*metadata, self._header))

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._with_key(details), request)

    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._with_key(details), request)

    async def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(self._with_key(details), requests)

    async def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(self._with_key(details), requests)


async def start_harness(
    engine: AsyncEngine,
    config: ServerConfig | None = None,
    model_dir: Path | None = None,
    *,
    bearer: str | None = None,
) -> Harness:
    """A server over `engine`; its channel sends `bearer` as the key of every call (the
    worker's control key, say) unless the call names its own."""
    running = await start_server(engine, with_transport(config or ServerConfig(port=0)))
    interceptors = [Bearer(bearer)] if bearer else None
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{running.port}", interceptors=interceptors)
    return Harness(engine, running, channel, pb_grpc.VllmEngineStub(channel), model_dir)


def request(
    prompt: list[int] | None = None, request_id: str = "", **sampling: Any
) -> pb.GenerateRequest:
    """A GenerateRequest for token ids `prompt` with the given sampling fields."""
    return pb.GenerateRequest(
        request_id=request_id,
        prompt_token_ids=prompt or [],
        sampling_params=pb.SamplingParams(**sampling),
    )


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


async def scrape(url: str) -> Samples:
    """Every sample of a Prometheus endpoint, parsed by prometheus_client's own parser,
    keyed by (sample name, sorted labels)."""
    from prometheus_client.parser import text_string_to_metric_families

    def fetch() -> str:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.read().decode()

    samples: Samples = {}
    for family in text_string_to_metric_families(await asyncio.to_thread(fetch)):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def delta(before: Samples, after: Samples, name: str, **labels: str) -> float:
    """How much one sample moved (0 where it did not exist before)."""
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


async def wait_until(
    predicate: Callable[[], bool], timeout: float = 10.0, what: str = "", every: float = 0.02
) -> None:
    """Poll `predicate` every `every` seconds until it holds; fail with `what` after
    `timeout` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        assert loop.time() < deadline, f"not reached in {timeout}s: {what or predicate}"
        await asyncio.sleep(every)


def real_engine_idle(harness: Harness) -> bool:
    """The engine's own view (not the servicer's): nothing unfinished, scheduler empty."""
    load = harness.engine.load()
    unfinished = harness.engine.llm.get_num_unfinished_requests()
    return unfinished == 0 and load.running_requests == 0 and load.waiting_requests == 0


async def collect_stream(
    stub: pb_grpc.VllmEngineStub, req: pb.GenerateRequest, **kwargs: Any
) -> list[pb.GenerateStreamResponse]:
    return [message async for message in stub.GenerateStream(req, **kwargs)]


async def read_rest(call: grpc.aio.UnaryStreamCall) -> list[Any]:
    """Read a stream (of any message) to its end after earlier `read()` calls (iteration
    cannot be mixed in)."""
    messages = []
    while (message := await call.read()) is not grpc.aio.EOF:
        messages.append(message)
    return messages
