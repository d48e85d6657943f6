"""SamplingParams.stream_interval: fewer messages, the same tokens; the first token and the
end are never held back. Mock and real engine (vLLM's own stream_interval)."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from vllm_router.proto import vllm_engine_pb2 as pb

from harness import Harness, collect_stream, request


async def check_interval(harness: Harness, max_tokens: int) -> None:
    def ask(**extra: Any) -> pb.GenerateRequest:
        return request([5, 6, 7], max_tokens=max_tokens, ignore_eos=True, seed=11, **extra)

    every_step = await collect_stream(harness.stub, ask())
    grouped = await collect_stream(harness.stub, ask(stream_interval=4))
    tokens = [t for m in every_step for t in m.token_ids]
    assert [t for m in grouped for t in m.token_ids] == tokens
    assert "".join(m.text_delta for m in grouped) == "".join(m.text_delta for m in every_step)
    sizes = [len(m.token_ids) for m in grouped]
    assert sizes[0] == 1  # the first token goes out at once
    assert all(size >= 4 for size in sizes[1:-1]), sizes
    assert len(grouped) < len(every_step)
    assert grouped[-1].is_finished and grouped[-1].finish_reason == "length"
    assert grouped[-1].usage.completion_tokens == max_tokens
    unary = await harness.stub.Generate(ask(stream_interval=4))
    assert list(unary.output_token_ids) == tokens


async def test_stream_interval_mock(mock: Harness) -> None:
    await check_interval(mock, max_tokens=14)


async def test_stream_interval_zero_is_refused(mock: Harness) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await mock.stub.Generate(request([5], max_tokens=2, stream_interval=0))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "stream_interval must be at least 1" in err.value.details()


@pytest.mark.vllm
async def test_stream_interval_real(real: Harness) -> None:
    await check_interval(real, max_tokens=14)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await real.stub.Generate(request([5], max_tokens=2, stream_interval=0))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "stream_interval must be at least 1" in err.value.details()
