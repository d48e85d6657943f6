"""Lean outputs (engine/vllm/lean.py) on the real engine: the same steps as vLLM's
RequestOutput path, request for request; the path is taken only where it may be; a
request left early or aborted is gone from the engine; vLLM's own statistics still count
every token and finish."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
from output_paths import PathCounts, counting_paths

from vllm_router.engine import EngineStep, GenerationRequest, SamplingOptions

from harness import Harness, collect_stream, delta, real_engine_idle, request, scrape, wait_until

pytestmark = pytest.mark.vllm

PROMPT = [11, 22, 33, 44, 55]


@contextlib.contextmanager
def output_path(harness: Harness, lean: bool) -> Iterator[None]:
    engine = harness.engine
    before = engine.lean_outputs
    engine.lean_outputs = lean
    try:
        yield
    finally:
        engine.lean_outputs = before


def generation(
    request_id: str, *, prompt: list[int] = PROMPT, detokenize: bool = False, **sampling: Any
) -> GenerationRequest:
    return GenerationRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        prompt_text=None,
        sampling=SamplingOptions(**sampling),
        detokenize=detokenize,
    )


async def run(
    harness: Harness, lean: bool, req: GenerationRequest, counts: PathCounts | None = None
) -> list[EngineStep]:
    with output_path(harness, lean), counting_paths() as here:
        steps = [step async for step in harness.engine.generate(req)]
    assert here.lean_streams == (1 if lean else 0)
    if counts is not None:
        counts.lean_streams += here.lean_streams
        counts.fast_steps += here.fast_steps
    return steps


def outcome(steps: list[EngineStep]) -> dict[str, Any]:
    last = steps[-1]
    return {
        "token_ids": [t for s in steps for t in s.token_ids],
        "text": "".join(s.text for s in steps),
        "finished": [s.finished for s in steps].count(True),
        "finish_reason": last.finish_reason,
        "stop_reason": last.stop_reason,
        "usage": (last.prompt_tokens, last.completion_tokens, last.cached_tokens),
    }


CASES: dict[str, tuple[bool, dict[str, Any]]] = {
    "greedy ids": (False, {"temperature": 0.0, "max_tokens": 24, "ignore_eos": True}),
    "seeded sample ids": (False, {"temperature": 0.9, "seed": 7, "max_tokens": 20}),
    "text": (True, {"temperature": 0.0, "max_tokens": 24, "ignore_eos": True}),
    "stop token id": (False, {"temperature": 0.0, "max_tokens": 40, "ignore_eos": True}),
    "stop string": (True, {"temperature": 0.0, "max_tokens": 40, "ignore_eos": True}),
    "stop string kept": (
        True,
        {
            "temperature": 0.0,
            "max_tokens": 40,
            "ignore_eos": True,
            "include_stop_str_in_output": True,
        },
    ),
    "eos by logit bias": (False, {"temperature": 0.0, "max_tokens": 16}),
    "interval 4 text": (
        True,
        {"temperature": 0.0, "max_tokens": 19, "ignore_eos": True, "stream_interval": 4},
    ),
}


async def _case_options(harness: Harness, name: str, options: dict[str, Any]) -> dict[str, Any]:
    """Stop cases stop on what the free run produces, so they really stop mid-way."""
    if name.startswith("stop"):
        free = await run(harness, False, generation("probe", detokenize=True, **options))
        tokens = [t for s in free for t in s.token_ids]
        if name == "stop token id":
            return {**options, "stop_token_ids": (tokens[9],)}
        text = "".join(s.text for s in free)
        return {**options, "stop": (text[len(text) // 2 : len(text) // 2 + 3],)}
    if name == "eos by logit bias":
        eos = harness.engine.facts.eos_token_ids[0]
        return {**options, "logit_bias": {eos: 100.0}}
    return options


@pytest.mark.parametrize("name", list(CASES))
async def test_lean_steps_equal_request_output_steps(real: Harness, name: str) -> None:
    detokenize, options = CASES[name]
    options = await _case_options(real, name, options)
    reference = await run(real, False, generation(f"ref-{name}", detokenize=detokenize, **options))
    counts = PathCounts()
    lean = await run(
        real, True, generation(f"lean-{name}", detokenize=detokenize, **options), counts
    )
    assert outcome(lean) == outcome(reference)
    # Token-only requests take their plain decode steps on the fast path (fast_outputs.py):
    # all but the first (prefill) and the last (finish) of every step the engine made.
    fast = counts.fast_steps
    tokens = outcome(lean)["usage"][1]
    assert fast == (0 if detokenize else max(0, tokens - 2)), (fast, tokens)
    if name.startswith("stop"):
        assert outcome(lean)["finish_reason"] == "stop"
        assert outcome(lean)["usage"][1] < options["max_tokens"]
    if name == "eos by logit bias":
        assert outcome(lean)["stop_reason"] == real.engine.facts.eos_token_ids[0]
    if "stream_interval" in options:
        sizes = [len(s.token_ids) for s in lean]
        assert sizes[0] == 1 and all(size >= 4 for size in sizes[1:-1]), sizes
    elif name != "eos by logit bias":  # that one ends on its first token
        assert len(lean) > 1  # streamed step by step, not only at the end


async def test_requests_that_need_request_outputs_take_vllms_path(real: Harness) -> None:
    cases: dict[str, dict[str, Any]] = {
        "logprobs": {"logprobs": 2},
        "prompt logprobs": {"prompt_logprobs": 1},
        "two samples": {"n": 2, "temperature": 0.8, "seed": 3},
    }
    with output_path(real, True):
        for name, options in cases.items():
            with counting_paths() as counts:
                request = generation(name, max_tokens=4, **options)
                steps = [s async for s in real.engine.generate(request)]
            assert counts.lean_streams == 0, name
            assert steps[-1].finished


async def test_leaving_early_or_abort_ends_the_request_in_the_engine(real: Harness) -> None:
    with output_path(real, True):
        steps = real.engine.generate(generation("left", max_tokens=200, ignore_eos=True))
        taken = [await steps.__anext__() for _ in range(3)]
        assert all(not s.finished for s in taken)
        await steps.aclose()
        await wait_until(lambda: real_engine_idle(real), what="engine idle after leaving early")

        steps = real.engine.generate(generation("aborted", max_tokens=200, ignore_eos=True))
        await steps.__anext__()
        await real.engine.abort("aborted")
        rest = [s async for s in steps]
        assert rest[-1].finished and rest[-1].finish_reason == "abort"
        assert rest[-1].completion_tokens < 200
        await wait_until(lambda: real_engine_idle(real), what="engine idle after abort")


async def test_grpc_clients_on_the_lean_path_are_cancelled_and_counted(real: Harness) -> None:
    """Through the servicer: vLLM's own vllm: counters see every lean token and finish,
    and a client that hangs up mid-stream leaves nothing decoding."""
    before = await scrape(real.metrics_url)
    with counting_paths() as counts:
        streams = await asyncio.gather(
            *(
                collect_stream(real.stub, request(PROMPT, max_tokens=12, ignore_eos=True, seed=i))
                for i in range(4)
            )
        )
    assert counts.lean_streams == 4
    assert all(sum(len(m.token_ids) for m in s) == 12 for s in streams)
    after = await scrape(real.metrics_url)
    model = real.engine.facts.served_model_name
    labels = {"engine": "0", "model_name": model}
    assert delta(before, after, "vllm:generation_tokens_total", **labels) == 48
    assert (
        delta(before, after, "vllm:request_success_total", finished_reason="length", **labels) == 4
    )
    # One time-to-first-token and 11 inter-token latencies per request, whichever path
    # (vLLM's or the fast one) each step took.
    assert delta(before, after, "vllm:time_to_first_token_seconds_count", **labels) == 4
    assert delta(before, after, "vllm:inter_token_latency_seconds_count", **labels) == 44

    call = real.stub.GenerateStream(request(PROMPT, max_tokens=200, ignore_eos=True))
    await call.read()
    call.cancel()
    await wait_until(lambda: real_engine_idle(real), what="engine idle after the client left")


@pytest.mark.parametrize("name", ["greedy ids", "seeded sample ids"])
async def test_decode_steps_handed_to_the_consumers_sink_keep_their_order(
    real: Harness, name: str
) -> None:
    """`generate(receiver=...)`: plain steps go direct to the receiver while the consumer
    waits; the steps and the handed-off tokens, in the order they came, are vLLM's own
    outcome, and the receiver is told the request's completion tokens with each."""
    _, options = CASES[name]
    reference = await run(real, False, generation(f"ref-h-{name}", **options))
    arrived: list[list[int] | EngineStep] = []
    told: list[int] = []

    def take(token_ids: list[int], completion_tokens: int) -> bool:
        told.append(completion_tokens)
        arrived.append(token_ids)
        return True

    with output_path(real, True):
        request = generation(f"handed-{name}", **options)
        async for step in real.engine.generate(request, receiver=take):
            arrived.append(step)
    steps = [a for a in arrived if isinstance(a, EngineStep)]
    handed = [a for a in arrived if not isinstance(a, EngineStep)]
    tokens = [t for a in arrived for t in (a.token_ids if isinstance(a, EngineStep) else a)]
    assert tokens == outcome(reference)["token_ids"]
    assert len(handed) >= len(tokens) // 2  # most steps went direct, not yielded
    produced, counts = 0, []
    for a in arrived:
        produced += len(a.token_ids if isinstance(a, EngineStep) else a)
        if not isinstance(a, EngineStep):
            counts.append(produced)
    assert told == counts  # the request's completion tokens, told with each handed-off step
    assert {**outcome(steps), "token_ids": tokens} == outcome(reference)
    await wait_until(lambda: real_engine_idle(real), what="engine idle")
