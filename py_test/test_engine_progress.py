"""The engine progress watchdog on the mock (a stuck engine is engine death, a slow or idle or
paused one is not), and health watches that end with OK when the server stops."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from vllm_router.core.progress import silent_for
from vllm_router.proto import vllm_native_pb2 as npb
from vllm_router.proto import vllm_native_pb2_grpc as npb_grpc
from vllm_router.server import ServerConfig
from vllm_router.server.registry import CONTRACTS

from harness import StartServer, read_rest, request

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
TIMEOUT = 1.0  # the watchdog's timeout in these tests (seconds without a step)


def _config(**more: object) -> ServerConfig:
    return ServerConfig(
        port=0,
        shutdown_grace_seconds=1.0,
        engine_stall_timeout_seconds=TIMEOUT,
        **more,  # type: ignore[arg-type]
    )


def _native(ids: list[int], max_new: int) -> npb.GenerateRequest:
    req = npb.GenerateRequest(stopping=npb.StoppingCriteria(max_new_tokens=max_new))
    req.token_ids.ids.extend(ids)
    return req


async def test_a_stuck_engine_fails_every_request_and_the_worker(start_mock: StartServer) -> None:
    harness = await start_mock(_config(), step_delay=0.005, stall_after_tokens=30)
    health = health_pb2_grpc.HealthStub(harness.channel)
    ours = harness.stub.GenerateStream(request([10], max_tokens=1000))
    native = npb_grpc.InferenceStub(harness.channel).GenerateStream(_native([10], 1000))
    unary = harness.stub.Generate(request([12], max_tokens=1000))
    await ours.read()
    await native.read()
    started = time.monotonic()
    failures = []
    for call in (ours, native, unary):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await asyncio.wait_for(read_rest(call) if call is not unary else call, 10)
        failures.append((err.value.code(), err.value.details()))
    waited = time.monotonic() - started
    # Every request hears why, within the timeout and a poll (the stall began after ~10
    # tokens each; a hang would have run into wait_for's 10 s).
    assert waited < TIMEOUT + 2.0, waited
    for code, details in failures:
        assert code == grpc.StatusCode.UNAVAILABLE
        assert "stopped making progress" in details
    for service in ("", *(entry.service_name for entry in CONTRACTS)):
        answer = await health.Check(health_pb2.HealthCheckRequest(service=service))
        assert answer.status == NOT_SERVING, service
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await harness.stub.Generate(request([10], max_tokens=1))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "stopped making progress" in (err.value.details() or "")
    assert not harness.server.requests.in_flight
    assert harness.server.exit_code == 1  # the process exits non-zero: its supervisor restarts it


async def test_a_slow_step_that_recovers_is_only_slow(start_mock: StartServer) -> None:
    harness = await start_mock(
        _config(), step_delay=0.002, stall_after_tokens=5, stall_seconds=TIMEOUT / 2
    )
    messages = await read_rest(harness.stub.GenerateStream(request([10], max_tokens=40)))
    assert sum(len(m.token_ids) for m in messages) == 40
    assert messages[-1].finish_reason == "length"
    assert harness.server.exit_code == 0
    assert not harness.server.state.engine_dead


async def test_idle_paused_or_unread_is_no_stall(start_mock: StartServer) -> None:
    harness = await start_mock(_config(), step_delay=0.002)
    await asyncio.sleep(TIMEOUT * 1.5)  # idle: nothing owed
    # Paused on purpose with a request held (vLLM's keep mode): held, not stuck.
    control = npb_grpc.ControlStub(harness.channel)
    held = harness.stub.GenerateStream(request([10], max_tokens=20))
    await held.read()
    await control.PauseGeneration(npb.PauseGenerationRequest(mode=npb.PAUSE_MODE_KEEP))
    await asyncio.sleep(TIMEOUT * 1.5)
    assert silent_for(harness.engine) == 0.0
    await control.ResumeGeneration(npb.ResumeGenerationRequest())
    assert sum(len(m.token_ids) for m in await read_rest(held)) == 19
    # A client that reads nothing: its step waits for the client, the engine owes nothing.
    unread = harness.stub.GenerateStream(request([10], max_tokens=4000))
    await unread.read()
    await asyncio.sleep(TIMEOUT * 1.5)
    unread.cancel()
    assert harness.server.exit_code == 0
    assert not harness.server.state.engine_dead


async def test_health_watches_end_with_ok_after_not_serving(start_mock: StartServer) -> None:
    harness = await start_mock(ServerConfig(port=0, shutdown_grace_seconds=1.0))
    health = health_pb2_grpc.HealthStub(harness.channel)
    watches = [
        health.Watch(health_pb2.HealthCheckRequest(service=entry.service_name))
        for entry in CONTRACTS
    ]
    for watch in watches:
        assert (await watch.read()).status == SERVING
    stop = asyncio.create_task(harness.server.drain_and_stop())
    for watch in watches:
        heard = []
        while (message := await watch.read()) is not grpc.aio.EOF:
            heard.append(message.status)
        assert heard == [NOT_SERVING]
        assert await watch.code() == grpc.StatusCode.OK
    await stop
