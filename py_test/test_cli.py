"""The vllm-servicer process: flags, errors, readiness, signals and drain."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib.util
import re
import signal
import socket
import subprocess

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from vllm_router.proto import vllm_engine_pb2 as pb
from vllm_router.proto import vllm_engine_pb2_grpc as pb_grpc

import servers
from harness import read_rest, request, require

MOCK = ("--mock-engine", "--port", "0")


def _run(
    *args: str, without_vllm: bool = False, timeout: float = 120
) -> subprocess.CompletedProcess:
    return subprocess.run(
        servers.command(*args, without_vllm=without_vllm),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_without_vllm_and_without_mock_is_a_one_line_usage_error() -> None:
    result = _run("--model", "x", without_vllm=True)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "vLLM is not installed" in lines[0] and "--mock-engine" in lines[0]
    assert "Traceback" not in result.stderr


def test_help_without_vllm_lists_mock_flags() -> None:
    result = _run("--help", without_vllm=True)
    assert result.returncode == 0
    for flag in ("--mock-engine", "--mock-step-delay", "--port", "--shutdown-grace-seconds"):
        assert flag in result.stdout


def test_help_with_vllm_passes_every_engine_flag_through() -> None:
    require(importlib.util.find_spec("vllm") is not None, "vLLM is not installed")
    result = _run("--help")
    assert result.returncode == 0, result.stderr
    for flag in (
        "--model",
        "--tensor-parallel-size",
        "--max-model-len",
        "--enable-prefix-caching",
        "--data-parallel-size",
        "--mock-engine",
        "--port",
    ):
        assert flag in result.stdout, flag


async def test_mock_server_runs_without_vllm_and_stops_on_sigterm() -> None:
    server = await servers.start(*MOCK, without_vllm=True)
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            info = await pb_grpc.VllmEngineStub(channel).GetModelInfo(pb.GetModelInfoRequest())
        assert info.engine == "mock"
        server.process.send_signal(signal.SIGTERM)
        assert await server.wait(10) == 0
    finally:
        server.kill()
    log = "".join(server.log)
    assert "ready on 127.0.0.1:" in log
    # What start-up left alive is out of the collector's full collections (app.py says why).
    frozen = re.search(r"Start-up heap frozen: (\d+) objects", log)
    assert frozen is not None and int(frozen.group(1)) > 10_000, log


def test_port_in_use_is_a_one_line_error() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        result = _run("--mock-engine", "--port", str(port), timeout=30)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and f"127.0.0.1:{port}" in lines[0], result.stderr
    assert "Traceback" not in result.stderr


async def test_sigterm_drains_in_flight_streams_then_exits_zero() -> None:
    server = await servers.start(
        *MOCK, "--mock-step-delay", "0.02", "--shutdown-grace-seconds", "20"
    )
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = pb_grpc.VllmEngineStub(channel)
            streams = [stub.GenerateStream(request([10], max_tokens=60)) for _ in range(5)]
            for stream in streams:
                await stream.read()
            server.process.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.2)
            health = health_pb2_grpc.HealthStub(channel)
            assert (await health.Check(health_pb2.HealthCheckRequest())).status == (
                health_pb2.HealthCheckResponse.NOT_SERVING
            )
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Generate(request([10], max_tokens=1))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            for stream in streams:
                rest = await read_rest(stream)
                assert rest[-1].is_finished and rest[-1].usage.completion_tokens == 60
        assert await server.wait(15) == 0
    finally:
        server.kill()


async def test_grace_expiry_aborts_and_second_sigterm_is_immediate() -> None:
    server = await servers.start(
        *MOCK, "--mock-step-delay", "0.05", "--shutdown-grace-seconds", "60"
    )
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = pb_grpc.VllmEngineStub(channel)
            stream = stub.GenerateStream(request([10], max_tokens=4000))
            await stream.read()
            loop = asyncio.get_running_loop()
            started = loop.time()
            server.process.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)
            server.process.send_signal(signal.SIGTERM)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await read_rest(stream)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            # Well before the 60 s grace: the second signal aborted the request.
            assert loop.time() - started < 10
        assert await server.wait(15) == 0
    finally:
        server.kill()
    assert "aborting" in "".join(server.log)


def test_flags_derive_their_defaults_from_the_settings_dataclasses() -> None:
    from vllm_router.cli import build_parser
    from vllm_router.dataclass_flags import from_args
    from vllm_router.server import ServerConfig
    from vllm_router.testing.mock_engine import MockConfig

    args = build_parser(with_vllm=False).parse_args([])
    assert from_args(ServerConfig, args) == ServerConfig()
    assert from_args(MockConfig, args, prefix="mock_") == MockConfig()
    changed = build_parser(with_vllm=False).parse_args(
        ["--max-concurrent-streams", "7", "--mock-step-delay", "0.5", "--enable-log-requests"]
    )
    config = from_args(ServerConfig, changed)
    assert (config.max_concurrent_streams, config.enable_log_requests) == (7, True)
    assert from_args(MockConfig, changed, prefix="mock_").step_delay == 0.5


def test_empty_api_key_is_a_one_line_startup_error() -> None:
    result = _run("--mock-engine", "--port", "0", "--api-key", "", timeout=30)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "API key must not be empty" in lines[0], result.stderr


def test_output_path_flags_reach_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    require(importlib.util.find_spec("vllm") is not None, "vLLM is not installed")
    from vllm_router import cli
    from vllm_router.engine.vllm import VllmEngine

    seen: list[tuple[bool, bool]] = []

    def record(
        cls: type, engine_args: object, *, lean_outputs: bool = True, direct_entry: bool = True
    ) -> None:
        seen.append((lean_outputs, direct_entry))

    monkeypatch.setattr(VllmEngine, "from_engine_args", classmethod(record))
    parser = cli.build_parser(with_vllm=True)
    cli.build_engine(parser.parse_args(["--model", "m"]))
    cli.build_engine(parser.parse_args(["--model", "m", "--no-lean-outputs"]))
    cli.build_engine(parser.parse_args(["--model", "m", "--no-direct-entry"]))
    assert seen == [(True, True), (False, True), (True, False)]


def test_vllm_serving_flags_are_server_config_fields() -> None:
    require(importlib.util.find_spec("vllm") is not None, "vLLM is not installed")
    from vllm_router.cli import build_parser
    from vllm_router.dataclass_flags import from_args
    from vllm_router.server import ServerConfig

    parser = build_parser(with_vllm=True)
    assert from_args(ServerConfig, parser.parse_args(["--model", "m"])) == ServerConfig()
    args = parser.parse_args(
        ["--model", "m", "--no-lean-outputs", "--lora-modules", "a=/x", "b=/y"]
    )
    config = from_args(ServerConfig, args)
    assert (config.lean_outputs, config.lora_modules) == (False, ("a=/x", "b=/y"))


def test_vllm_serving_flags_are_not_offered_without_vllm() -> None:
    from vllm_router.cli import build_parser

    parser = build_parser(with_vllm=False)
    for flag in ("--no-lean-outputs", "--lora-modules"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--mock-engine", flag, "a=/x"])


def test_a_tuple_setting_is_a_flag_of_one_or_more_values() -> None:
    from vllm_router.dataclass_flags import add_flags, from_args

    @dataclasses.dataclass(frozen=True)
    class Settings:
        names: tuple[str, ...] | None = dataclasses.field(
            default=None, metadata={"help": "names", "metavar": "NAME"}
        )

    parser = argparse.ArgumentParser()
    add_flags(parser, Settings)
    assert from_args(Settings, parser.parse_args([])) == Settings()
    assert from_args(Settings, parser.parse_args(["--names", "a", "b"])).names == ("a", "b")
    assert "--names NAME [NAME ...]" in parser.format_help()
