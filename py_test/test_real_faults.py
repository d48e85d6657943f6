"""Killing the real engine's core process: streams fail fast, health flips, the process exits 1."""

from __future__ import annotations

import asyncio
import time

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from vllm_router.proto import vllm_engine_pb2_grpc as pb_grpc

import servers
from harness import read_rest, request
from real_engine import cli_flags, require_vllm, tiny_model

pytestmark = pytest.mark.vllm


def _engine_core(pid: int) -> psutil.Process:
    for child in psutil.Process(pid).children(recursive=True):
        if "EngineCore" in " ".join([child.name(), *child.cmdline()]):
            return child
    raise AssertionError("no EngineCore process found")


# What a health probe can hear from a worker whose engine died: NOT_SERVING while it drains,
# the call refused once the server has begun to stop.
NOT_SERVING = (health_pb2.HealthCheckResponse.NOT_SERVING, "CANCELLED", "UNAVAILABLE")


def _named(heard: object) -> object:
    """A serving status by its name (a refused probe is named by its status code already)."""
    if isinstance(heard, int):
        return health_pb2.HealthCheckResponse.ServingStatus.Name(heard)  # type: ignore[arg-type]
    return heard


async def _health_now(health: health_pb2_grpc.HealthStub) -> object:
    try:
        return (await health.Check(health_pb2.HealthCheckRequest(), timeout=5)).status
    except grpc.aio.AioRpcError as err:
        return err.code().name


async def test_killing_the_engine_core_mid_stream(figures) -> None:
    require_vllm()
    model = tiny_model()
    # The health poll is far away: only the death signal itself can flip health in time.
    server = await servers.start(
        "--model", str(model), "--port", "0", "--health-poll-seconds", "30", *cli_flags(),
        timeout=240,
    )  # fmt: skip
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = pb_grpc.VllmEngineStub(channel)
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
            streams = [
                stub.GenerateStream(request([5 + i, 6, 7], max_tokens=240, ignore_eos=True))
                for i in range(16)
            ]
            for stream in streams:
                await stream.read()
            _engine_core(server.process.pid).kill()
            killed = time.monotonic()
            health = health_pb2_grpc.HealthStub(channel)
            codes = []
            health_after_first_failure = None
            for stream in streams:
                try:
                    await asyncio.wait_for(read_rest(stream), 10)
                    codes.append("OK")
                except grpc.aio.AioRpcError as err:
                    codes.append(err.code().name)
                    if health_after_first_failure is None:
                        health_after_first_failure = await _health_now(health)
            # A stream heard of the death: every health answer already had. (Or the worker
            # already stops, as engine death makes it, and refuses the probe: not SERVING either.)
            assert health_after_first_failure in NOT_SERVING, health_after_first_failure
            ended_after = time.monotonic() - killed
            assert "UNAVAILABLE" in codes and set(codes) <= {"UNAVAILABLE", "OK"}, codes
            assert ended_after < 5, ended_after
            statuses = []
            with pytest.raises(grpc.aio.AioRpcError):
                while True:
                    statuses.append((await asyncio.wait_for(watch.read(), 10)).status)
            assert health_pb2.HealthCheckResponse.NOT_SERVING in statuses
        exit_code = await server.wait(60)
        figures(
            f"engine core killed with 16 streams in flight: {codes.count('UNAVAILABLE')} ended "
            f"UNAVAILABLE, {codes.count('OK')} had finished, all within {ended_after:.2f}s; "
            f"health probe then: {_named(health_after_first_failure)}; "
            f"process exit code {exit_code}"
        )
        assert exit_code == 1
    finally:
        server.kill()
