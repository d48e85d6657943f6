"""GenerateBatch over the real engine: one message per engine step for every request on the
stream, with exactly GenerateStream's tokens, text and finishes; nothing left running."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
from batches import Answers, Requests, generate, read_all

from vllm_router.client import WorkerClient
from vllm_router.proto import vllm_engine_pb2 as pb

from harness import Harness, collect_stream, delta, real_engine_idle, request, scrape, wait_until

pytestmark = pytest.mark.vllm


def prompts(count: int) -> dict[str, list[int]]:
    return {f"batch-{i}": [5 + i, 40 + 3 * i, 77 + i] for i in range(count)}


async def test_every_request_on_one_stream_gets_generate_streams_answer(
    real: Harness, figures
) -> None:
    asked = prompts(8)
    sampling: dict[str, Any] = {"temperature": 0.0, "max_tokens": 24, "ignore_eos": True}
    call = real.stub.GenerateBatch(
        [generate(p, rid, **sampling) for rid, p in asked.items()]
        + [generate([9, 10, 11], "seeded", temperature=1.0, seed=7, max_tokens=12)]
    )
    answers = Answers()
    await read_all(call, answers)
    assert await call.code() == grpc.StatusCode.OK
    assert answers.errors == {} and answers.refused == []
    for rid, prompt in [*asked.items(), ("seeded", [9, 10, 11])]:
        seeded: dict[str, Any] = {"temperature": 1.0, "seed": 7, "max_tokens": 12}
        params = sampling if rid != "seeded" else seeded
        single = await collect_stream(real.stub, request(prompt, **params))
        assert answers.tokens(rid) == [t for m in single for t in m.token_ids], rid
        text = "".join(u.text_delta for u in answers.updates[rid])
        assert text == "".join(m.text_delta for m in single), rid
        assert answers.last(rid).finish_reason == single[-1].finish_reason
        assert answers.last(rid).usage == single[-1].usage
    # Per engine step, one message for all: far fewer messages than request-steps.
    request_steps = sum(len(u) for u in answers.updates.values())
    widest = max(answers.per_message)
    figures(f"9 requests on one GenerateBatch stream: {request_steps} request-steps in "
            f"{answers.messages} messages, up to {widest} requests per message")  # fmt: skip
    assert widest >= 6, answers.per_message
    assert answers.messages * 3 < request_steps
    await wait_until(lambda: real_engine_idle(real), 5.0, "the engine to be idle")


async def test_leaving_a_batch_stream_aborts_its_requests_in_the_engine(real: Harness) -> None:
    async with WorkerClient(real.address) as worker:
        batch = worker.batch()
        streams = [
            batch.stream(p, max_tokens=200, ignore_eos=True, skip_detokenize=True)
            for p in prompts(4).values()
        ]
        firsts = await asyncio.gather(*(anext(s) for s in streams))
        assert all(m.token_ids for m in firsts)
        assert real.engine.load().running_requests + real.engine.load().waiting_requests == 4
        await batch.close_now()
    await wait_until(lambda: real_engine_idle(real), 5.0, "the engine to be idle")
    await wait_until(lambda: not real.server.requests.in_flight, 5.0, "the table to be empty")


async def test_an_abort_on_the_stream_ends_that_request_as_abort(real: Harness) -> None:
    outgoing = Requests()
    call = real.stub.GenerateBatch(outgoing.stream())
    answers = Answers()
    await outgoing.put(generate([3, 4, 5], "cut", max_tokens=200, ignore_eos=True))
    await outgoing.put(generate([6, 7, 8], "whole", max_tokens=30, ignore_eos=True))
    while not (answers.updates.get("cut") and answers.updates.get("whole")):
        answers.take(await call.read())
    await outgoing.put(pb.GenerateBatchRequest(abort=pb.AbortRequest(request_ids=["cut"])))
    await outgoing.put(None)
    await read_all(call, answers)
    assert answers.last("cut").finish_reason == "abort"
    assert len(answers.tokens("cut")) < 200
    assert len(answers.tokens("whole")) == 30
    await wait_until(lambda: real_engine_idle(real), 5.0, "the engine to be idle")


async def test_handed_over_decode_steps_keep_tokens_usage_and_vllm_statistics(
    real: Harness, figures
) -> None:
    """Token-only requests asking for the compact shape: their decode steps go from vLLM's
    output loop straight into the stream's next message (no task per request per step),
    with GenerateStream's tokens and usage, and vLLM's own statistics (generation tokens,
    one inter-token latency per token after the first, observed by value) exactly as
    vLLM's path counts them."""
    asked = prompts(8)
    sampling: dict[str, Any] = {"temperature": 0.0, "max_tokens": 40, "ignore_eos": True}
    labels = {"engine": "0", "model_name": real.engine.facts.served_model_name}
    before = await scrape(real.metrics_url)
    call = real.stub.GenerateBatch(
        [
            generate(p, rid, skip_detokenize=True, compact=True, **sampling)
            for rid, p in asked.items()
        ]
    )
    answers = Answers()
    await read_all(call, answers)
    after = await scrape(real.metrics_url)
    assert await call.code() == grpc.StatusCode.OK and answers.errors == {}
    for rid, prompt in asked.items():
        single = await collect_stream(real.stub, request(prompt, **sampling))
        assert answers.tokens(rid) == [t for m in single for t in m.token_ids], rid
        assert answers.last(rid).usage == single[-1].usage, rid
    handed = sum(len(u) - 2 for u in answers.updates.values())
    figures(f"8 compact requests x 40 tokens: {answers.compact_runs} compact runs, "
            f"{answers.messages} messages")  # fmt: skip
    assert answers.compact_runs >= handed > 8 * 20
    assert delta(before, after, "vllm:generation_tokens_total", **labels) == 8 * 40
    itl = "vllm:inter_token_latency_seconds"
    assert delta(before, after, f"{itl}_count", **labels) == 8 * 39
    buckets = [
        v - before.get(k, 0.0)
        for k, v in after.items()
        if k[0] == f"{itl}_bucket" and ("le", "+Inf") in k[1]
    ]
    assert buckets == [8 * 39]
    assert 0 < delta(before, after, f"{itl}_sum", **labels) < 8 * 39 * 5.0
    assert delta(before, after, "vllm_servicer:generated_tokens_total") == 8 * 40
    await wait_until(lambda: real_engine_idle(real), 5.0, "the engine to be idle")
