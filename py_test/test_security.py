"""TLS, mutual TLS, the shared API key, the unix socket and request-log hygiene."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from vllm_router.proto import vllm_engine_pb2 as pb
from vllm_router.proto import vllm_engine_pb2_grpc as pb_grpc
from vllm_router.server import ServerConfig, StartupError

from harness import NATIVE_TRANSPORT, StartServer, request

API_KEY = "s3cret-token-for-tests"
GENERATE = request([10], max_tokens=2)


def _tls_config(pki, *, mutual: bool) -> ServerConfig:
    return ServerConfig(
        port=0,
        ssl_certfile=str(pki["server_cert_path"]),
        ssl_keyfile=str(pki["server_key_path"]),
        ssl_ca_certs=str(pki["ca_path"]) if mutual else None,
    )


async def _generate(channel: grpc.aio.Channel, **kwargs) -> pb.GenerateResponse:
    return await pb_grpc.VllmEngineStub(channel).Generate(GENERATE, timeout=5, **kwargs)


def _secure(port: int, pki, cert: str | None = None) -> grpc.aio.Channel:
    credentials = grpc.ssl_channel_credentials(
        root_certificates=pki["ca"],
        private_key=pki[f"{cert}_key"] if cert else None,
        certificate_chain=pki[f"{cert}_cert"] if cert else None,
    )
    return grpc.aio.secure_channel(f"localhost:{port}", credentials)


async def _refused_on_native(start_mock: StartServer, config: ServerConfig, what: str) -> None:
    """--transport native cannot serve `config`: it refuses to start, saying `what`."""
    with pytest.raises(StartupError, match=what) as err:
        await start_mock(config)
    assert "\n" not in str(err.value) and "--transport grpcio" in str(err.value)


async def test_tls_serves_trusting_clients_and_refuses_plaintext(
    start_mock: StartServer, pki
) -> None:
    if NATIVE_TRANSPORT:  # pygrpc-native has no TLS: never plaintext in its place
        await _refused_on_native(start_mock, _tls_config(pki, mutual=False), "no TLS")
        return
    harness = await start_mock(_tls_config(pki, mutual=False))
    async with _secure(harness.server.port, pki) as channel:
        assert list((await _generate(channel)).output_token_ids) == [11, 12]
    async with grpc.aio.insecure_channel(harness.address) as plain:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _generate(plain)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_mutual_tls_refuses_missing_and_untrusted_client_certs(
    start_mock: StartServer, pki
) -> None:
    if NATIVE_TRANSPORT:
        await _refused_on_native(start_mock, _tls_config(pki, mutual=True), "no TLS")
        return
    harness = await start_mock(_tls_config(pki, mutual=True))
    port = harness.server.port
    async with _secure(port, pki, "client") as channel:
        assert list((await _generate(channel)).output_token_ids) == [11, 12]
    for cert in (None, "bad"):
        async with _secure(port, pki, cert) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await _generate(channel)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, cert
    async with grpc.aio.insecure_channel(harness.address) as plain:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _generate(plain)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_api_key_required_everywhere_but_health(start_mock: StartServer) -> None:
    harness = await start_mock(ServerConfig(port=0, api_key=API_KEY))
    stub = harness.stub
    for metadata in (None, (("authorization", "Bearer wrong"),), (("authorization", API_KEY),)):
        for call in (
            stub.Generate(GENERATE, metadata=metadata),
            stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=metadata),
            stub.HealthCheck(pb.HealthCheckRequest(), metadata=metadata),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "Bearer" in err.value.details() and API_KEY not in err.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in stub.GenerateStream(GENERATE, metadata=metadata):
                pass
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        reflection = reflection_pb2_grpc.ServerReflectionStub(harness.channel)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            request = reflection_pb2.ServerReflectionRequest(list_services="")
            async for _ in reflection.ServerReflectionInfo(iter([request]), metadata=metadata):
                pass
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    good = (("authorization", f"Bearer {API_KEY}"),)
    assert list((await stub.Generate(GENERATE, metadata=good)).output_token_ids) == [11, 12]
    assert (await stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=good)).engine == "mock"
    health = health_pb2_grpc.HealthStub(harness.channel)
    status = await health.Check(health_pb2.HealthCheckRequest())  # probes need no token
    assert status.status == health_pb2.HealthCheckResponse.SERVING


async def test_unix_socket_alone_with_owner_only_mode(
    start_mock: StartServer, tmp_path: Path
) -> None:
    socket_path = tmp_path / "servicer.sock"
    harness = await start_mock(ServerConfig(port=-1, uds=str(socket_path)))
    assert harness.server.port == 0  # no TCP listener
    assert stat.S_IMODE(os.stat(socket_path).st_mode) == 0o600
    async with grpc.aio.insecure_channel(f"unix:{socket_path}") as channel:
        assert list((await _generate(channel)).output_token_ids) == [11, 12]


async def test_unix_socket_beside_tcp(start_mock: StartServer, tmp_path: Path) -> None:
    socket_path = tmp_path / "both.sock"
    if NATIVE_TRANSPORT:  # one listener only
        config = ServerConfig(port=0, uds=str(socket_path))
        await _refused_on_native(start_mock, config, "one listener")
        return
    harness = await start_mock(ServerConfig(port=0, uds=str(socket_path)))
    async with grpc.aio.insecure_channel(f"unix:{socket_path}") as channel:
        assert list((await _generate(channel)).output_token_ids) == [11, 12]
    assert list((await _generate(harness.channel)).output_token_ids) == [11, 12]
