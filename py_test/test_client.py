"""The client library (`vllm_router.client`): typed calls, typed errors, the worker's own
tokenizer fetched once and cached by digest."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from pathlib import Path
from typing import cast

import pytest

from vllm_router.client import (
    AlreadyExistsError,
    AuthenticationError,
    InvalidRequestError,
    UnavailableError,
    UnsupportedError,
    WorkerClient,
)
from vllm_router.proto import vllm_engine_pb2 as pb
from vllm_router.server import ServerConfig

from harness import Harness, StartServer, delta, scrape, wait_until


async def test_calls_and_answers(mock: Harness) -> None:
    async with WorkerClient(mock.address) as worker:
        assert await worker.health()
        info = await worker.model_info()
        assert info.engine == "mock" and info.tokenizer_sha256 == ""
        reply = await worker.generate([10, 11], max_tokens=3, ignore_eos=True)
        assert list(reply.output_token_ids) == [12, 13, 14]
        streamed = [m async for m in worker.stream([10], max_tokens=4, ignore_eos=True)]
        assert [t for m in streamed for t in m.token_ids] == [11, 12, 13, 14]
        assert streamed[-1].finish_reason == "length"
        loads = await worker.loads()
        assert loads.requests_in_flight == 0 and len(loads.ranks) == 1
        assert await worker.abort("nobody") == []
        assert await worker.reset_prefix_cache() is True
        # No tokenizer files on the mock: text goes to the worker, which tokenizes it.
        text = await worker.generate("ab", max_tokens=1)
        assert text.usage.prompt_tokens == 2


async def test_leaving_a_stream_early_cancels_the_request(mock: Harness) -> None:
    async with WorkerClient(mock.address) as worker:
        # stream() is an async generator, typed as an AsyncIterator: aclose() is there.
        stream = cast(
            "AsyncGenerator[pb.GenerateStreamResponse, None]",
            worker.stream([10], request_id="left", max_tokens=3000, ignore_eos=True),
        )
        async for _ in stream:
            assert mock.server.requests.in_flight == {"left"}
            break
        await stream.aclose()
        await wait_until(lambda: not mock.server.requests.in_flight, what="request cancelled")
        assert mock.engine.load().running_requests == 0


async def test_errors_are_typed(start_mock: StartServer) -> None:
    harness = await start_mock(ServerConfig(port=0, api_key="key"), step_delay=0.01)
    async with WorkerClient(harness.address, api_key="key") as worker:
        with pytest.raises(InvalidRequestError) as err:
            await worker.generate([1] * 5000, max_tokens=1)
        assert "max_model_len" in err.value.details
        busy = cast(
            "AsyncGenerator[pb.GenerateStreamResponse, None]",
            worker.stream([1], request_id="same", max_tokens=3000, ignore_eos=True),
        )
        await busy.__anext__()
        with pytest.raises(AlreadyExistsError):
            await worker.generate([1], request_id="same", max_tokens=1)
        assert await worker.abort("same", "other") == ["same"]
        with pytest.raises(UnsupportedError):
            await worker.tokenizer()
        await busy.aclose()
    async with WorkerClient(harness.address, api_key="wrong") as worker:
        assert await worker.health()  # grpc.health.v1 needs no key
        with pytest.raises(AuthenticationError) as auth_err:
            await worker.model_info()
        assert auth_err.value.code.name == "UNAUTHENTICATED"
    harness.engine.kill()
    async with WorkerClient(harness.address, api_key="key") as worker:
        with pytest.raises(UnavailableError):
            await worker.generate([1], max_tokens=1)


async def test_unreachable_worker_is_unavailable() -> None:
    async with WorkerClient("127.0.0.1:1", timeout=5) as worker:
        with pytest.raises(UnavailableError):
            await worker.model_info()


@pytest.mark.vllm
async def test_text_is_tokenized_with_the_workers_tokenizer_fetched_once(
    real: Harness, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_SERVICER_TOKENIZER_CACHE", str(tmp_path))
    text = "Good servers drain in-flight work before they stop."
    server_side = await real.stub.Generate(
        pb.GenerateRequest(
            prompt_text=text, sampling_params=pb.SamplingParams(max_tokens=6, seed=7)
        )
    )
    before = await scrape(real.metrics_url)
    async with WorkerClient(real.address) as worker:
        ids = await worker.tokenize(text)
        reply = await worker.generate(text, max_tokens=6, seed=7)
    assert reply.usage.prompt_tokens == len(ids) == server_side.usage.prompt_tokens
    assert list(reply.output_token_ids) == list(server_side.output_token_ids)
    assert reply.output_text == server_side.output_text
    digest = (await real.stub.GetModelInfo(pb.GetModelInfoRequest())).tokenizer_sha256
    assert (tmp_path / "tokenizers" / digest / "tokenizer.json").is_file()
    # A second client finds the files in the cache: no second GetTokenizer.
    async with WorkerClient(real.address) as worker:
        assert await worker.tokenize(text) == ids
    after = await scrape(real.metrics_url)
    fetches = delta(
        before, after, "vllm_servicer:requests_total",
        code="OK", method="GetTokenizer", service="vllm.engine.v1.VllmEngine",
    )  # fmt: skip
    assert fetches == 1


@pytest.mark.vllm
async def test_stream_of_text_matches_unary(real: Harness) -> None:
    async with WorkerClient(real.address) as worker:
        unary = await worker.generate([5, 6, 7], max_tokens=8, ignore_eos=True, seed=3)
        messages = [
            m async for m in worker.stream([5, 6, 7], max_tokens=8, ignore_eos=True, seed=3)
        ]
    assert [t for m in messages for t in m.token_ids] == list(unary.output_token_ids)
    assert "".join(m.text_delta for m in messages) == unary.output_text
