"""Keepalive: a client that pings every second through a long silent call stays connected."""

from __future__ import annotations

import grpc
import pytest

from vllm_router.core import RequestTable, ServingCore, ServingState
from vllm_router.proto import vllm_engine_pb2_grpc as pb_grpc
from vllm_router.testing.mock_engine import MockAsyncEngine, MockConfig
from vllm_router.vllm_servicer import VllmEngineServicer

from harness import StartServer, request

# A client that pings once a second and never gives up pinging while a call is silent.
PINGING_CLIENT = [
    ("grpc.keepalive_time_ms", 1000),
    ("grpc.keepalive_timeout_ms", 5000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]

# Four steps 5 s apart: the unary call carries no data for 15 s.
SILENT_REQUEST = request([10], max_tokens=4)


@pytest.mark.slow  # make test only: it waits or builds for over ten seconds
async def test_pinging_client_survives_a_15_second_silent_unary_call(
    start_mock: StartServer,
) -> None:
    harness = await start_mock(step_delay=5.0)
    async with grpc.aio.insecure_channel(harness.address, options=PINGING_CLIENT) as channel:
        response = await pb_grpc.VllmEngineStub(channel).Generate(SILENT_REQUEST, timeout=60)
    assert list(response.output_token_ids) == [11, 12, 13, 14]


async def test_control_default_server_policy_disconnects_the_same_client() -> None:
    """Proves the test above can fail: gRPC's default ping policy sends GOAWAY."""
    engine = MockAsyncEngine(MockConfig(step_delay=5.0))
    state = ServingState(engine)
    server = grpc.aio.server()  # no keepalive options
    pb_grpc.add_VllmEngineServicer_to_server(
        VllmEngineServicer(ServingCore(engine, RequestTable(engine, state), state)), server
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=PINGING_CLIENT) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await pb_grpc.VllmEngineStub(ch).Generate(SILENT_REQUEST, timeout=60)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "ping" in (err.value.details() + err.value.debug_error_string()).lower()
    finally:
        await server.stop(0)
