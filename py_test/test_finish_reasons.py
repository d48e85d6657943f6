"""Honest endings: vLLM's `error` and `repetition` finishes in both contracts, and engine
death reaching every health answer before any failing stream's status does (mock engine)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc

from vllm_router.proto import vllm_engine_pb2 as pb
from vllm_router.server import ServerConfig
from vllm_router.testing.mock_engine import FAULT_ERROR

from harness import StartServer, collect_stream, delta, request, scrape

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _official(prompt: list[int], stream: bool, **sampling: object) -> vpb.GenerateRequest:
    return vpb.GenerateRequest(
        request_id="official",
        tokenized=vpb.TokenizedInput(input_ids=prompt),
        sampling_params=vpb.SamplingParams(**sampling),
        stream=stream,
    )


async def test_an_error_finish_fails_our_rpcs_unavailable_with_the_engines_message(
    start_mock: StartServer,
) -> None:
    harness = await start_mock(ServerConfig(port=0, metrics_port=0), fault_finish_reason="error")
    before = await scrape(harness.metrics_url)
    for call in (collect_stream(harness.stub, request([10], max_tokens=8)),
                 harness.stub.Generate(request([10], max_tokens=8))):  # fmt: skip
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert FAULT_ERROR in err.value.details() and "another worker" in err.value.details()
    after = await scrape(harness.metrics_url)
    assert delta(before, after, "vllm_servicer:finish_reason_total", reason="error") == 2
    # One request failed, not the worker: it still serves.
    health = health_pb2_grpc.HealthStub(harness.channel)
    assert (await health.Check(health_pb2.HealthCheckRequest())).status == SERVING
    assert not harness.server.requests.in_flight


async def test_repetition_is_its_own_finish_reason_in_our_contract(
    start_mock: StartServer,
) -> None:
    harness = await start_mock(
        ServerConfig(port=0, metrics_port=0), fault_finish_reason="repetition"
    )
    before = await scrape(harness.metrics_url)
    messages = await collect_stream(harness.stub, request([10], max_tokens=8, stop=["zz"]))
    last = messages[-1]
    assert (last.is_finished, last.finish_reason, last.usage.completion_tokens) == (
        True, "repetition", 2,
    )  # fmt: skip
    assert last.WhichOneof("matched_stop") is None  # no stop string or token matched
    unary = await harness.stub.Generate(request([10], max_tokens=8))
    assert (unary.finish_reason, list(unary.output_token_ids)) == ("repetition", [11, 12])
    after = await scrape(harness.metrics_url)
    assert delta(before, after, "vllm_servicer:finish_reason_total", reason="repetition") == 2


@pytest.mark.parametrize("stream", [True, False])
async def test_repetition_passes_through_vllms_contract(
    start_mock: StartServer, stream: bool
) -> None:
    harness = await start_mock(fault_finish_reason="repetition")
    stub = vpb_grpc.VllmEngineStub(harness.channel)
    replies = [r async for r in stub.Generate(_official([10], stream, max_tokens=8))]
    complete = replies[-1].complete
    assert (complete.finish_reason, list(complete.output_ids)) == (
        "repetition", [12] if stream else [11, 12],
    )  # fmt: skip
    assert complete.WhichOneof("matched_stop") is None


@pytest.mark.parametrize("stream", [True, False])
async def test_an_error_finish_on_vllms_contract_is_a_complete_as_vllms_server_sends(
    start_mock: StartServer, stream: bool
) -> None:
    """vLLM's --grpc server answers an `error` finish with a complete (status OK); the SMG
    router turns it into HTTP 500 for its client. Same here, and the worker serves on."""
    harness = await start_mock(fault_finish_reason="error")
    stub = vpb_grpc.VllmEngineStub(harness.channel)
    replies = [r async for r in stub.Generate(_official([10], stream, max_tokens=8))]
    assert replies[-1].complete.finish_reason == "error"
    assert not harness.server.requests.in_flight and not harness.engine.errored


async def test_max_tokens_past_the_context_is_refused_on_ours_and_filled_on_vllms(
    start_mock: StartServer,
) -> None:
    harness = await start_mock(max_model_len=16)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await harness.stub.Generate(request([10, 11], max_tokens=100, ignore_eos=True))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "ask for at most 14 tokens" in err.value.details()
    stub = vpb_grpc.VllmEngineStub(harness.channel)
    replies = [
        r async for r in stub.Generate(_official([10, 11], False, max_tokens=100, ignore_eos=True))
    ]
    assert (replies[-1].complete.finish_reason, replies[-1].complete.completion_tokens) == (
        "length", 14,
    )  # fmt: skip


async def test_engine_death_flips_every_health_answer_before_a_stream_hears_of_it(
    start_mock: StartServer,
) -> None:
    # The poll is far away: only the death signal itself can flip health in time.
    harness = await start_mock(
        ServerConfig(port=0, health_poll_seconds=60.0, shutdown_grace_seconds=2.0),
        step_delay=0.005,
    )
    health = health_pb2_grpc.HealthStub(harness.channel)
    watch = health.Watch(health_pb2.HealthCheckRequest())
    assert (await watch.read()).status == SERVING
    streams = [
        harness.stub.GenerateStream(request([10 + i], max_tokens=4000, ignore_eos=True))
        for i in range(12)
    ]
    for stream in streams:
        await stream.read()
    harness.engine.kill()
    first_failure = asyncio.Queue[grpc.aio.AioRpcError]()

    async def read_to_end(stream: grpc.aio.UnaryStreamCall) -> None:
        try:
            while await stream.read() is not grpc.aio.EOF:
                pass
        except grpc.aio.AioRpcError as err:
            first_failure.put_nowait(err)

    readers = [asyncio.ensure_future(read_to_end(s)) for s in streams]
    err = await asyncio.wait_for(first_failure.get(), 10)
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    # The moment the first stream has failed, every health surface says NOT_SERVING.
    check = await health.Check(health_pb2.HealthCheckRequest())
    assert check.status == NOT_SERVING
    for service in harness.server.services:
        reply = await health.Check(health_pb2.HealthCheckRequest(service=service))
        assert reply.status == NOT_SERVING, service
    ours = await harness.stub.HealthCheck(pb.HealthCheckRequest())
    assert ours.status == ours.NOT_SERVING
    theirs = await vpb_grpc.VllmEngineStub(harness.channel).HealthCheck(vpb.HealthCheckRequest())
    assert not theirs.healthy
    assert (await watch.read()).status == NOT_SERVING
    await asyncio.gather(*readers)
    assert harness.server.exit_code == 1  # the worker goes on to exit for a restart
