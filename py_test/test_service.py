"""Model info, health (custom RPC and grpc.health.v1), prefix cache, reflection, engine death."""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc

from vllm_router.proto import vllm_engine_pb2 as pb
from vllm_router.server import ServerConfig
from vllm_router.testing.mock_engine import MockAsyncEngine

from harness import Harness, StartServer, read_rest, request, start_harness

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE = "vllm.engine.v1.VllmEngine"
VLLM_GRPC_SERVICE = "vllm.grpc.engine.VllmEngine"


async def test_model_info_reads_the_engine_config(start_mock: StartServer) -> None:
    harness = await start_mock(
        model_name="tiny", vocab_size=777, max_model_len=321, eos_token_id=5, dp_size=2
    )
    info = await harness.stub.GetModelInfo(pb.GetModelInfoRequest())
    assert (info.model_name, info.served_model_name) == ("tiny", "tiny")
    assert (info.vocab_size, info.max_model_len, info.dp_size, info.block_size) == (777, 321, 2, 16)
    assert list(info.eos_token_ids) == [5]
    assert info.engine == "mock" and info.engine_version


async def test_health_check_rpc_and_standard_health_service(mock: Harness) -> None:
    ours = await mock.stub.HealthCheck(pb.HealthCheckRequest())
    assert ours.status == pb.HealthCheckResponse.SERVING
    standard = health_pb2_grpc.HealthStub(mock.channel)
    for service in ("", SERVICE):
        reply = await standard.Check(health_pb2.HealthCheckRequest(service=service))
        assert reply.status == SERVING
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await standard.Check(health_pb2.HealthCheckRequest(service="no.such.Service"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


async def test_reset_prefix_cache_true_when_idle_false_while_running(
    start_mock: StartServer,
) -> None:
    harness = await start_mock(step_delay=0.05)
    await harness.stub.Generate(request([10] * 40, max_tokens=2))
    again = await harness.stub.Generate(request([10] * 40, max_tokens=2))
    assert again.usage.cached_tokens == 32  # two full 16-token blocks were cached
    reset = await harness.stub.ResetPrefixCache(pb.ResetPrefixCacheRequest())
    assert reset.success and not reset.message
    after = await harness.stub.Generate(request([10] * 40, max_tokens=2))
    assert after.usage.cached_tokens == 0

    stream = harness.stub.GenerateStream(request([10], max_tokens=1000))
    await stream.read()
    busy = await harness.stub.ResetPrefixCache(pb.ResetPrefixCacheRequest())
    assert not busy.success
    assert "1 running" in busy.message
    stream.cancel()


async def _reflected_services(channel: grpc.aio.Channel) -> set[str]:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    call = stub.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")])
    )
    replies = [reply async for reply in call]
    return {s.name for s in replies[0].list_services_response.service}


async def test_reflection_lists_every_service(start_mock: StartServer) -> None:
    every = await start_mock()
    assert await _reflected_services(every.channel) == {
        SERVICE,
        VLLM_GRPC_SERVICE,
        "vllm.Inference",
        "vllm.Control",
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
    }
    ours_only = await start_mock(ServerConfig(port=0, vllm_grpc=False, vllm_native=False))
    assert await _reflected_services(ours_only.channel) == {
        SERVICE,
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
    }
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await vpb_grpc.VllmEngineStub(ours_only.channel).HealthCheck(vpb.HealthCheckRequest())
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


async def test_engine_death_mid_stream(start_mock: StartServer) -> None:
    harness = await start_mock(
        ServerConfig(port=0, health_poll_seconds=0.05, shutdown_grace_seconds=1.0),
        step_delay=0.02,
    )
    standard = health_pb2_grpc.HealthStub(harness.channel)
    watch = standard.Watch(health_pb2.HealthCheckRequest(service=SERVICE))
    assert (await watch.read()).status == SERVING
    stream = harness.stub.GenerateStream(request([10], max_tokens=1000))
    await stream.read()
    harness.engine.kill("test fault")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await read_rest(stream)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "dead" in err.value.details()
    assert (await asyncio.wait_for(watch.read(), 2.0)).status == NOT_SERVING
    ours = await harness.stub.HealthCheck(pb.HealthCheckRequest())
    assert ours.status == pb.HealthCheckResponse.NOT_SERVING
    for call in (
        harness.stub.Generate(request([10], max_tokens=1)),
        harness.stub.GetModelInfo(pb.GetModelInfoRequest()),
        harness.stub.ResetPrefixCache(pb.ResetPrefixCacheRequest()),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert harness.server.exit_code == 1  # the process will exit non-zero after draining


async def test_drain_finishes_in_flight_and_refuses_new(start_mock: StartServer) -> None:
    harness = await start_mock(ServerConfig(port=0, shutdown_grace_seconds=10.0), step_delay=0.01)
    standard = health_pb2_grpc.HealthStub(harness.channel)
    stream = harness.stub.GenerateStream(request([10], max_tokens=50))
    await stream.read()
    drain = asyncio.create_task(harness.server.drain_and_stop())
    await asyncio.sleep(0.05)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await harness.stub.Generate(request([10], max_tokens=1))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "draining" in err.value.details()
    ours = await harness.stub.HealthCheck(pb.HealthCheckRequest())
    assert ours.status == pb.HealthCheckResponse.NOT_SERVING
    assert (await standard.Check(health_pb2.HealthCheckRequest())).status == NOT_SERVING
    rest = await read_rest(stream)
    assert rest[-1].is_finished and rest[-1].usage.completion_tokens == 50
    await drain


async def test_drain_aborts_what_outlives_the_grace(start_mock: StartServer) -> None:
    harness = await start_mock(ServerConfig(port=0, shutdown_grace_seconds=0.3), step_delay=0.01)
    stream = harness.stub.GenerateStream(request([10], request_id="long", max_tokens=4000))
    await stream.read()
    await harness.server.drain_and_stop()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await read_rest(stream)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "grace" in err.value.details()
    assert "long" in harness.engine.aborted_ids
    assert harness.engine.load().running_requests == 0


class _BuggyEngine(MockAsyncEngine):
    """An engine whose generate has a bug of ours: a plain ValueError, not a client error."""

    async def generate(self, request, *, receiver=None):  # type: ignore[override]
        raise ValueError("bug: something nobody anticipated")
        yield  # pragma: no cover


async def test_a_bug_is_internal_and_logged_not_a_client_mistake(
    caplog: pytest.LogCaptureFixture,
) -> None:
    harness = await start_harness(_BuggyEngine(), ServerConfig(port=0))
    try:
        caplog.set_level(logging.ERROR, logger="vllm_router")
        for call in (harness.stub.Generate, harness.stub.GenerateStream):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                result = call(request([10], max_tokens=2))
                if call is harness.stub.GenerateStream:
                    async for _ in result:
                        pass
                else:
                    await result
            assert err.value.code() == grpc.StatusCode.INTERNAL
            assert "ValueError" in err.value.details()
        assert "RPC failed unexpectedly" in caplog.text and "Traceback" in caplog.text
        assert harness.server.requests.in_flight == frozenset()
    finally:
        await harness.close()
