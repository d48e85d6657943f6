"""End-to-end on a real model and a CUDA GPU (skipped on machines without one).

MODEL_PATH names the model (a local directory or a hub id); the default is a
small instruct model. Run on a GPU machine with `make test` or
`.venv/bin/pytest py_test/e2e`.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
from collections.abc import AsyncIterator
from typing import cast

import grpc
import pytest
import pytest_asyncio

from vllm_router.proto import vllm_engine_pb2 as pb
from vllm_router.proto import vllm_engine_pb2_grpc as pb_grpc
from vllm_router.server import RunningServer, ServerConfig, start_server

pytestmark = pytest.mark.gpu
MODEL = os.environ.get("MODEL_PATH", "Qwen/Qwen2.5-0.5B-Instruct")


def _cuda_available() -> bool:
    if importlib.util.find_spec("vllm") is None or importlib.util.find_spec("torch") is None:
        return False
    import torch

    return torch.cuda.is_available()


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def gpu() -> AsyncIterator[tuple[RunningServer, pb_grpc.VllmEngineStub]]:
    if not _cuda_available():
        pytest.skip("no CUDA device: GPU end-to-end tests run on GPU machines only")
    from vllm.engine.arg_utils import AsyncEngineArgs

    from vllm_router.engine.vllm import VllmEngine

    engine = VllmEngine.from_engine_args(
        AsyncEngineArgs(model=MODEL, gpu_memory_utilization=0.5, max_model_len=2048, seed=0)
    )
    running = await start_server(engine, ServerConfig(port=0))
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{running.port}")
    try:
        yield running, pb_grpc.VllmEngineStub(channel)
    finally:
        await channel.close()
        await running.drain_and_stop()


def _prompt_ids(text: str) -> list[int]:
    from transformers import AutoTokenizer, BatchEncoding

    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    messages = [{"role": "user", "content": text}]
    # return_dict=True: a BatchEncoding (the stubs give the union of every return form).
    encoded = cast(
        BatchEncoding,
        tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=True
        ),
    )
    return list(encoded["input_ids"])


async def test_greedy_factual_answer(gpu) -> None:
    _, stub = gpu
    ids = _prompt_ids("What is the capital of France? Answer with one word.")
    response = await stub.Generate(
        pb.GenerateRequest(
            prompt_token_ids=ids, sampling_params=pb.SamplingParams(temperature=0, max_tokens=16)
        )
    )
    assert "Paris" in response.output_text
    assert response.finish_reason in ("stop", "length")


async def test_stream_equals_unary_and_cancel_aborts(gpu) -> None:
    running, stub = gpu
    ids = _prompt_ids("Count from one to fifty in words.")
    request = pb.GenerateRequest(
        prompt_token_ids=ids, sampling_params=pb.SamplingParams(temperature=0, max_tokens=64)
    )
    unary = await stub.Generate(request)
    streamed = [t async for m in stub.GenerateStream(request) for t in m.token_ids]
    assert streamed == list(unary.output_token_ids)
    long = pb.GenerateRequest(
        prompt_token_ids=ids,
        sampling_params=pb.SamplingParams(temperature=0, max_tokens=1500, ignore_eos=True),
    )
    call = stub.GenerateStream(long)
    await call.read()
    call.cancel()
    for _ in range(200):
        if running.engine.llm.get_num_unfinished_requests() == 0:
            break
        await asyncio.sleep(0.02)
    assert running.engine.llm.get_num_unfinished_requests() == 0


async def test_model_info(gpu) -> None:
    _, stub = gpu
    info = await stub.GetModelInfo(pb.GetModelInfoRequest())
    assert info.engine == "vllm" and info.max_model_len == 2048 and info.vocab_size > 1000
