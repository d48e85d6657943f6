"""Admission limits, stalled readers, port sharing and what request logging reveals."""

from __future__ import annotations

import asyncio
import logging
import signal

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from vllm_router.proto import vllm_engine_pb2_grpc as pb_grpc
from vllm_router.server import PortUnavailable, ServerConfig, start_server
from vllm_router.testing.mock_engine import MockAsyncEngine

import servers
from harness import StartServer, read_rest, request, wait_until, with_transport


async def test_max_concurrent_streams_rejects_at_once(start_mock: StartServer) -> None:
    harness = await start_mock(ServerConfig(port=0, max_concurrent_streams=2), step_delay=0.05)
    streams = [harness.stub.GenerateStream(request([10], max_tokens=1000)) for _ in range(2)]
    for stream in streams:
        await stream.read()
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await harness.stub.Generate(request([10], max_tokens=1))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "--max-concurrent-streams 2" in err.value.details()
    assert loop.time() - started < 1.0  # refused, not queued
    streams[0].cancel()
    await wait_until(lambda: len(harness.server.requests.in_flight) == 1)
    ok = await harness.stub.Generate(request([10], max_tokens=1))
    assert list(ok.output_token_ids) == [11]
    streams[1].cancel()


async def test_max_prompt_tokens(start_mock: StartServer) -> None:
    harness = await start_mock(ServerConfig(port=0, max_prompt_tokens=8))
    ok = await harness.stub.Generate(request([10] * 8, max_tokens=1))
    assert list(ok.output_token_ids) == [11]
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await harness.stub.Generate(request([10] * 9, max_tokens=1))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "--max-prompt-tokens" in err.value.details()


async def test_client_that_stops_reading_is_aborted_after_the_stall_timeout(
    start_mock: StartServer,
) -> None:
    harness = await start_mock(
        ServerConfig(port=0, stream_stall_timeout_seconds=0.5),
        tokens_per_step=2000,
        max_model_len=50_000_000,
    )
    stream = harness.stub.GenerateStream(
        request([10], request_id="stalled", max_tokens=40_000_000, ignore_eos=True)
    )
    await stream.read()  # then never read again: flow control backs up on the server
    await wait_until(lambda: "stalled" in harness.engine.aborted_ids, timeout=30)
    await wait_until(lambda: not harness.server.requests.in_flight)
    assert harness.engine.load().running_requests == 0
    stream.cancel()


async def test_second_server_on_the_same_port_fails() -> None:
    first = await start_server(MockAsyncEngine(), with_transport(ServerConfig(port=0)))
    try:
        with pytest.raises(PortUnavailable):
            await start_server(MockAsyncEngine(), with_transport(ServerConfig(port=first.port)))
    finally:
        await first.drain_and_stop()


async def test_request_log_has_ids_and_lengths_never_tokens(
    start_mock: StartServer, caplog: pytest.LogCaptureFixture
) -> None:
    harness = await start_mock(ServerConfig(port=0, enable_log_requests=True))
    caplog.set_level(logging.INFO, logger="vllm_router")
    await harness.stub.Generate(request([12345, 23456, 31234], request_id="logged", max_tokens=1))
    text = caplog.text
    assert "logged" in text and "3 prompt tokens" in text
    assert "12345" not in text and "23456" not in text
    quiet = await start_mock()
    caplog.clear()
    await quiet.stub.Generate(request([10], request_id="quiet", max_tokens=1))
    assert "quiet" not in caplog.text  # off by default


async def test_sigterm_with_50_streams_in_flight() -> None:
    server = await servers.start(
        "--mock-engine",
        "--port",
        "0",
        "--mock-step-delay",
        "0.02",
        "--shutdown-grace-seconds",
        "30",
    )
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = pb_grpc.VllmEngineStub(channel)
            streams = [stub.GenerateStream(request([10], max_tokens=100)) for _ in range(50)]
            for stream in streams:
                await stream.read()
            server.process.send_signal(signal.SIGTERM)
            results = await asyncio.gather(*(read_rest(s) for s in streams))
            assert all(r[-1].is_finished and r[-1].usage.completion_tokens == 100 for r in results)
        assert await server.wait(15) == 0
    finally:
        server.kill()


async def test_engine_death_makes_the_process_exit_non_zero() -> None:
    server = await servers.start(
        "--mock-engine", "--port", "0", "--mock-step-delay", "0.01", "--mock-die-after-tokens", "60"
    )
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = pb_grpc.VllmEngineStub(channel)
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
            streams = [stub.GenerateStream(request([10], max_tokens=1000)) for _ in range(4)]
            loop = asyncio.get_running_loop()
            started = loop.time()
            for stream in streams:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await read_rest(stream)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert loop.time() - started < 5
            statuses = []
            while (message := await watch.read()) is not grpc.aio.EOF:
                statuses.append(message.status)
            # NOT_SERVING, then the Watch ends with OK as the server stops: a goodbye.
            assert statuses[-1] == health_pb2.HealthCheckResponse.NOT_SERVING, statuses
            assert await watch.code() == grpc.StatusCode.OK
        assert await server.wait(15) == 1
    finally:
        server.kill()
    assert "Engine is dead" in "".join(server.log)
