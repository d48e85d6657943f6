"""Every bad input gets a precise status and a message naming the field; the server stays up."""

from __future__ import annotations

import math

import grpc
import pytest

from vllm_router.proto import vllm_engine_pb2 as pb
from vllm_router.server import ServerConfig

from harness import Harness, StartServer, request

INVALID = grpc.StatusCode.INVALID_ARGUMENT
UNIMPLEMENTED = grpc.StatusCode.UNIMPLEMENTED
VOCAB, MAX_LEN = 32000, 4096  # the mock's defaults


def _with(**fields: object) -> pb.GenerateRequest:
    req = request([10], max_tokens=2)
    for name, value in fields.items():
        if name == "multimodal_data":
            req.multimodal_data.add(modality="image", data=b"\x89PNG")
        else:
            setattr(req, name, value)
    return req


CASES = [
    ("empty prompt", pb.GenerateRequest(), INVALID, "prompt"),
    ("token id = vocab", request([5, VOCAB]), INVALID, "prompt_token_ids[1] = 32000"),
    ("token id 2^32-1", request([2**32 - 1]), INVALID, "prompt_token_ids[0]"),
    ("prompt = max_model_len", request([5] * MAX_LEN), INVALID, "max_model_len"),
    ("prompt + max_tokens > context", request([5] * 4000, max_tokens=97), INVALID, "max_tokens"),
    ("max_tokens 2^32-1", request([10], max_tokens=2**32 - 1), INVALID, "max_tokens"),
    ("temperature NaN", request([10], temperature=math.nan), INVALID, "temperature"),
    ("temperature inf", request([10], temperature=math.inf), INVALID, "temperature"),
    ("temperature -1", request([10], temperature=-1.0), INVALID, "temperature"),
    ("temperature 3", request([10], temperature=3.0), INVALID, "temperature"),
    ("top_p 0", request([10], top_p=0.0), INVALID, "top_p"),
    ("top_p 1.5", request([10], top_p=1.5), INVALID, "top_p"),
    ("top_p NaN", request([10], top_p=math.nan), INVALID, "top_p"),
    ("top_k -2", request([10], top_k=-2), INVALID, "top_k"),
    ("min_p 1.5", request([10], min_p=1.5), INVALID, "min_p"),
    ("max_tokens 0", request([10], max_tokens=0), INVALID, "max_tokens"),
    ("min_tokens > max_tokens", request([10], max_tokens=2, min_tokens=3), INVALID, "min_tokens"),
    ("frequency_penalty 3", request([10], frequency_penalty=3.0), INVALID, "frequency_penalty"),
    ("presence_penalty -3", request([10], presence_penalty=-3.0), INVALID, "presence_penalty"),
    ("repetition_penalty 0", request([10], repetition_penalty=0.0), INVALID, "repetition_penalty"),
    (
        "repetition_penalty inf",
        request([10], repetition_penalty=math.inf),
        INVALID,
        "repetition_penalty",
    ),
    ("empty stop string", request([10], stop=["ok", ""]), INVALID, "stop[1]"),
    ("too many stop strings", request([10], stop=["x"] * 10_000), INVALID, "sampling_params.stop"),
    ("logprobs -2", request([10], logprobs=-2), INVALID, "logprobs"),
    ("logprobs 1000", request([10], logprobs=1000), INVALID, "logprobs"),
    ("1 MiB request_id", _with(request_id="r" * (1 << 20)), INVALID, "request_id"),
    ("dp_rank huge", _with(dp_rank=2**32 - 1), INVALID, "dp_rank"),
    ("prefill-only mode", _with(execution_mode=1), UNIMPLEMENTED, "execution_mode"),
    ("decode-only mode", _with(execution_mode=2), UNIMPLEMENTED, "execution_mode"),
    ("unknown execution_mode", _with(execution_mode=7), INVALID, "execution_mode"),
    ("image on a text-only model", _with(multimodal_data=True), INVALID, "text-only"),
    ("1M prompt tokens", request([5] * 1_000_000, max_tokens=1), INVALID, "max_model_len"),
    ("max_tokens 2^31-1", request([10], max_tokens=2**31 - 1), INVALID, "max_tokens"),
    ("stop string too long", request([10], stop=["x" * 2000]), INVALID, "stop[0]"),
    ("min_tokens 2^32-1", request([10], max_tokens=2, min_tokens=2**32 - 1), INVALID, "min_tokens"),
    ("min_p negative", request([10], min_p=-0.1), INVALID, "min_p"),
    ("min_p NaN", request([10], min_p=math.nan), INVALID, "min_p"),
    ("top_p negative", request([10], top_p=-1.0), INVALID, "top_p"),
    ("temperature 2.5", request([10], temperature=2.5), INVALID, "temperature"),
    ("presence_penalty inf", request([10], presence_penalty=math.inf), INVALID, "presence_penalty"),
    (
        "frequency_penalty NaN",
        request([10], frequency_penalty=math.nan),
        INVALID,
        "frequency_penalty",
    ),
    (
        "repetition_penalty -1",
        request([10], repetition_penalty=-1.0),
        INVALID,
        "repetition_penalty",
    ),
    ("negative execution_mode", _with(execution_mode=-1), INVALID, "execution_mode"),
    ("dp_rank = dp_size", _with(dp_rank=1), INVALID, "dp_rank 1"),
    ("257-byte request_id", _with(request_id="é" * 128 + "x"), INVALID, "request_id"),
    ("logprobs -1 (whole vocabulary)", request([10], logprobs=-1), INVALID, "logprobs"),
]


@pytest.mark.parametrize(
    ("req", "code", "needle"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
async def test_bad_request_gets_precise_status(
    mock: Harness, req: pb.GenerateRequest, code: grpc.StatusCode, needle: str
) -> None:
    for rpc in ("Generate", "GenerateStream"):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            call = getattr(mock.stub, rpc)(req)
            if rpc == "GenerateStream":
                async for _ in call:
                    pass
            else:
                await call
        assert err.value.code() == code, (rpc, err.value.details())
        assert needle in err.value.details(), (rpc, err.value.details())
    # Nothing was left in flight and the server still serves.
    assert mock.server.requests.in_flight == frozenset()
    health = await mock.stub.HealthCheck(pb.HealthCheckRequest())
    assert health.status == pb.HealthCheckResponse.SERVING


async def test_stop_strings_need_detokenization(mock: Harness) -> None:
    req = request([10], max_tokens=2, stop=["x"])
    req.skip_detokenize = True
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await mock.stub.Generate(req)
    assert err.value.code() == INVALID
    assert "stop strings" in err.value.details()


async def test_oversized_message_is_resource_exhausted(start_mock: StartServer) -> None:
    harness = await start_mock(ServerConfig(port=0, max_message_bytes=64 * 1024))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await harness.stub.Generate(request([7] * 100_000, max_tokens=1))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    ok = await harness.stub.Generate(request([7], max_tokens=1))
    assert list(ok.output_token_ids) == [8]


@pytest.mark.parametrize(
    "raw",
    [b"\x0a\x02\xff\xfe\x12\x01\x0a", b"\xff\xff\xff", b"\x12\x05\x0a"],
    ids=["bad UTF-8 in request_id", "corrupt tag", "truncated packed ids"],
)
async def test_unparsable_bytes_are_invalid_argument(mock: Harness, raw: bytes) -> None:
    for method, style in (("Generate", "unary_unary"), ("GenerateStream", "unary_stream")):
        call = getattr(mock.channel, style)(f"/vllm.engine.v1.VllmEngine/{method}")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            result = call(raw)
            if style == "unary_stream":
                async for _ in result:
                    pass
            else:
                await result
        assert err.value.code() == INVALID, err.value.details()
        assert "could not be parsed" in err.value.details()
