"""The direct entry (engine/vllm/entry.py) and shared SamplingParams on the real engine: a
token-id request enters the engine core without AsyncLLM.add_request and gets what it
would have got through it (steps, refusals, the engine left idle); the requests it does not
admit take add_request; a vLLM whose add_request does more turns it off."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator
from typing import Any

import pytest
from output_paths import counting_paths
from test_lean_outputs import generation

from vllm_router.engine import EngineStep, StructuredOutputs
from vllm_router.engine.vllm import VllmEngine, compat
from vllm_router.engine.vllm.entry import DirectEntry, VllmCall
from vllm_router.engine.vllm.stats import LoadBoard
from vllm_router.errors import InvalidRequest

from harness import Harness, real_engine_idle, wait_until

pytestmark = pytest.mark.vllm

PROMPT = [11, 22, 33, 44, 55, 66]


@contextlib.contextmanager
def entry_off(engine: VllmEngine) -> Iterator[None]:
    entry = engine.direct_entry
    engine.direct_entry = None
    try:
        yield
    finally:
        engine.direct_entry = entry


def outcome(steps: list[EngineStep]) -> dict[str, Any]:
    last = steps[-1]
    return {
        "token_ids": [t for s in steps for t in s.token_ids],
        "text": "".join(s.text for s in steps),
        "finish": (last.finish_reason, last.stop_reason),
        "usage": (last.prompt_tokens, last.completion_tokens, last.cached_tokens),
    }


CASES: dict[str, tuple[bool, dict[str, Any]]] = {
    "greedy ids": (False, {"temperature": 0.0, "max_tokens": 24, "ignore_eos": True}),
    "seeded sample": (False, {"temperature": 0.9, "seed": 11, "max_tokens": 20}),
    "text, stop string": (True, {"temperature": 0.0, "max_tokens": 40, "ignore_eos": True}),
    "unset max_tokens": (False, {"temperature": 0.0, "min_tokens": 3, "top_k": 5}),
}


@pytest.mark.parametrize("case", CASES)
async def test_a_direct_entry_streams_what_add_request_streams(real: Harness, case: str) -> None:
    detokenize, sampling = CASES[case]
    engine = real.engine
    assert engine.direct_entry is not None and compat.DIRECT_ENTRY in engine.features
    if case.startswith("text"):
        # A stop string the greedy continuation reaches: read it from a run first.
        with entry_off(engine):
            probe = [s async for s in engine.generate(generation("de-probe", detokenize=True,
                                                                 **sampling))]  # fmt: skip
        sampling = {**sampling, "stop": ("".join(s.text for s in probe)[6:10],)}
    with entry_off(engine), counting_paths() as through_add_request:
        expected = [s async for s in engine.generate(
            generation(f"de-ref-{case}", detokenize=detokenize, **sampling))]  # fmt: skip
    with counting_paths() as direct:
        steps = [s async for s in engine.generate(
            generation(f"de-{case}", detokenize=detokenize, **sampling))]  # fmt: skip
    assert (through_add_request.direct_entries, direct.direct_entries) == (0, 1)
    assert outcome(steps) == outcome(expected)
    assert outcome(steps)["token_ids"]
    await wait_until(lambda: real_engine_idle(real), timeout=10)


async def test_a_refusal_is_add_request_s_refusal(real: Harness) -> None:
    """vLLM's own validation runs on the direct entry: the same error, the same words."""
    engine = real.engine
    max_len = engine.facts.max_model_len
    too_long = generation("de-long", prompt=[5] * (max_len + 1), max_tokens=4)
    out_of_vocabulary = generation("de-vocab", prompt=[10**7], max_tokens=4)
    for bad in (too_long, out_of_vocabulary):
        errors = []
        for entry in (True, False):
            with contextlib.ExitStack() as stack:
                if not entry:
                    stack.enter_context(entry_off(engine))
                with pytest.raises(Exception) as caught:
                    async for _ in engine.generate(bad):
                        pass
            errors.append((type(caught.value), str(caught.value)))
        assert errors[0] == errors[1], bad.request_id
        assert errors[0][0] is InvalidRequest, errors[0]
    assert not engine.llm.output_processor.request_states
    assert real_engine_idle(real)


async def test_a_request_left_early_is_gone_from_the_engine(real: Harness) -> None:
    engine = real.engine
    with counting_paths() as counts:
        steps = engine.generate(generation("de-left", temperature=0.0, max_tokens=200,
                                           ignore_eos=True))  # fmt: skip
        taken = [await steps.__anext__() for _ in range(3)]
        await steps.aclose()
    assert counts.direct_entries == 1 and sum(len(s.token_ids) for s in taken) >= 3
    await wait_until(lambda: real_engine_idle(real), timeout=10)
    assert not engine.llm.output_processor.request_states


async def test_a_failed_engine_core_send_leaves_nothing_registered(
    real: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def refused(self: DirectEntry, request: Any) -> None:
        raise RuntimeError("injected: the engine core's socket refused the request")

    monkeypatch.setattr(DirectEntry, "send", refused)
    steps = real.engine.generate(generation("de-send", temperature=0.0, max_tokens=8))
    with pytest.raises(RuntimeError, match="injected"):
        async for _ in steps:
            pass
    monkeypatch.undo()
    assert not real.engine.llm.output_processor.request_states
    await wait_until(lambda: real_engine_idle(real), timeout=10)


async def test_trace_headers_reach_vllm_only_where_it_traces(
    real: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As add_request: kept in the engine-core request when vLLM exports traces, dropped
    (vLLM's one warning) when it does not."""
    engine = real.engine
    entry = engine.direct_entry
    assert entry is not None
    seen: list[Any] = []
    processor = engine.llm.input_processor
    process_inputs = processor.process_inputs

    def recording(*args: Any, **kwargs: Any) -> Any:
        seen.append(kwargs.get("trace_headers"))
        return process_inputs(*args, **kwargs)

    monkeypatch.setattr(processor, "process_inputs", recording)
    headers = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}
    for tracing in (False, True):
        monkeypatch.setattr(entry, "_tracing", tracing)
        request = generation(f"de-trace-{tracing}", temperature=0.0, max_tokens=2)
        request = dataclasses.replace(request, trace_headers=headers)
        assert [s async for s in engine.generate(request)]
    assert seen == [None, headers]
    await wait_until(lambda: real_engine_idle(real), timeout=10)


def _call(**changes: Any) -> VllmCall:
    from vllm.sampling_params import SamplingParams

    values: dict[str, Any] = {
        "request_id": "r",
        "prompt": {"type": "token", "prompt_token_ids": PROMPT},
        "prompt_token_ids": PROMPT,
        "params": SamplingParams(max_tokens=4),
        "options": {"lora_request": None, "priority": 0},
        "detokenize": False,
    }
    values.update(changes)
    return VllmCall(**values)


def test_the_entry_admits_only_token_prompts_of_one_sample_without_lora() -> None:
    from vllm.sampling_params import SamplingParams

    assert DirectEntry.admits(_call())
    media = {"type": "multimodal", "prompt_token_ids": PROMPT, "mm_kwargs": {}}
    assert not DirectEntry.admits(_call(prompt=media))
    assert not DirectEntry.admits(_call(prompt={**_call().prompt, "prompt": "text"}))
    assert not DirectEntry.admits(_call(params=SamplingParams(n=2, max_tokens=4)))
    assert not DirectEntry.admits(_call(params=SamplingParams(prompt_logprobs=1, max_tokens=4)))
    assert not DirectEntry.admits(_call(options={"lora_request": object()}))


async def test_an_add_request_that_does_more_turns_the_entry_off(
    real: Harness, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A vLLM whose add_request makes a call entry.py does not make (say, a pause check)."""
    sampling: dict[str, Any] = {"temperature": 0.0, "max_tokens": 10, "ignore_eos": True}
    expected = [s async for s in real.engine.generate(generation("de-drift-ref", **sampling))]
    calls = dict(compat.ADD_REQUEST_CALLS)
    calls["_add_request"] = tuple(c for c in calls["_add_request"] if c != "logger.info")
    monkeypatch.setattr(compat, "ADD_REQUEST_CALLS", calls)
    with caplog.at_level(logging.WARNING, logger=compat.__name__):
        drifted = VllmEngine(real.engine.llm, LoadBoard())
    lines = [r.getMessage() for r in caplog.records if "touch point" in r.getMessage()]
    assert len(lines) == 1 and "AsyncLLM._add_request calls differ" in lines[0], lines
    assert "logger.info" in lines[0]
    assert drifted.direct_entry is None and compat.DIRECT_ENTRY not in drifted.features
    assert drifted.lean_outputs  # only its own feature is off
    with counting_paths() as counts:
        steps = [s async for s in drifted.generate(generation("de-drift", **sampling))]
    assert counts.direct_entries == 0 and counts.lean_streams == 1
    assert outcome(steps) == outcome(expected)


async def test_requests_with_equal_options_share_their_sampling_params(real: Harness) -> None:
    engine = real.engine
    greedy: dict[str, Any] = {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True}
    first = engine._sampling_params(generation("a", **greedy), len(PROMPT))
    assert engine._sampling_params(generation("b", **greedy), len(PROMPT)) is first
    # Another seed: vLLM's own clone of it with that seed, nothing else changed.
    seeded = engine._sampling_params(generation("c", **greedy, seed=3), len(PROMPT))
    assert seeded is not first and seeded.seed == 3 and first.seed is None
    assert {**vars_of_params(seeded), "seed": None} == vars_of_params(first)
    # Anything else that differs builds its own.
    other = engine._sampling_params(generation("c", **{**greedy, "max_tokens": 13}), 6)
    assert other is not first and other.max_tokens == 13
    text = dataclasses.replace(generation("d", **greedy), detokenize=True)
    assert engine._sampling_params(text, len(PROMPT)) is not first
    # A default max_tokens is the prompt's room: per prompt length.
    unset = generation("e", temperature=0.0)
    room = engine.facts.max_model_len
    assert engine._sampling_params(unset, 6).max_tokens == room - 6
    assert engine._sampling_params(unset, 9).max_tokens == room - 9
    # Never shared: a logit bias (unhashable), structured outputs (vLLM writes its backend
    # into the params it validates), KV-transfer parameters (one request's own).
    bias = generation("f", temperature=0.0, max_tokens=4, logit_bias={5: 1.0})
    assert engine._sampling_params(bias, 6) is not engine._sampling_params(bias, 6)
    constrained = generation("g", max_tokens=4, structured_outputs=StructuredOutputs(regex="a+"))
    assert engine._sampling_params(constrained, 6) is not engine._sampling_params(constrained, 6)
    kv = dataclasses.replace(generation("h", **greedy),
                             kv_transfer_params={"do_remote_prefill": False})  # fmt: skip
    assert engine._sampling_params(kv, 6) is not engine._sampling_params(kv, 6)
    # Requests that ran on shared params leave them as built.
    before = (list(first.stop_token_ids or ()), first.max_tokens, first.seed)
    for i in range(2):
        steps = [s async for s in engine.generate(generation(f"share-{i}", **greedy))]
        assert sum(len(s.token_ids) for s in steps) == 12
    assert (list(first.stop_token_ids or ()), first.max_tokens, first.seed) == before


def vars_of_params(params: Any) -> dict[str, Any]:
    return {name: getattr(params, name) for name in params.__struct_fields__}


def test_the_renderer_s_eos_id_is_the_tokenizer_s(real: Harness) -> None:
    llm = real.engine.llm
    assert llm.renderer.get_eos_token_id() == llm.get_tokenizer().eos_token_id is not None
