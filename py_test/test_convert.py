"""Pure conversion functions, no server."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from collections.abc import Callable
from typing import cast

import pytest

from vllm_router.contracts.vllm_engine_v1 import convert, responses
from vllm_router.contracts.vllm_engine_v1.rules import tokenizer_digest
from vllm_router.core.accumulate import RequestResult
from vllm_router.core.prompts import check_prompt
from vllm_router.engine import EngineStep, ModelFacts, SamplingOptions, TokenLogprob
from vllm_router.errors import InvalidRequest, Unsupported
from vllm_router.proto import vllm_engine_pb2 as pb

from harness import require

FACTS = ModelFacts("m", "m", 100, 50, 2, 16, (2,), "mock", "0")


def test_unset_sampling_fields_stay_unset_and_zero_is_kept() -> None:
    options = convert.to_sampling_options(pb.SamplingParams(temperature=0.0, top_k=0, seed=0))
    assert options.temperature == 0.0 and options.top_k == 0 and options.seed == 0
    assert options.top_p is None and options.max_tokens is None and options.logprobs is None


def test_generation_request_fields() -> None:
    req = pb.GenerateRequest(
        request_id="x", prompt_token_ids=[0, 49], dp_rank=1, skip_detokenize=True
    )
    out = convert.to_generation_request(req, FACTS)
    assert (out.request_id, out.prompt_token_ids, out.dp_rank, out.detokenize) == (
        "x",
        [0, 49],
        1,
        False,
    )


@pytest.mark.parametrize(
    ("req", "error", "needle"),
    [
        (pb.GenerateRequest(prompt_token_ids=[1], dp_rank=2), InvalidRequest, "0..1"),
        (
            pb.GenerateRequest(prompt_token_ids=[1], execution_mode=cast("pb.ExecutionMode", 1)),
            Unsupported,
            "PREFILL",
        ),
        (
            pb.GenerateRequest(prompt_token_ids=[1], execution_mode=cast("pb.ExecutionMode", 9)),
            InvalidRequest,
            "9",
        ),
        (pb.GenerateRequest(), InvalidRequest, "prompt is empty"),
        (pb.GenerateRequest(prompt_token_ids=[1], request_id="é" * 200), InvalidRequest, "400"),
    ],
)
def test_validation(req: pb.GenerateRequest, error: type[Exception], needle: str) -> None:
    with pytest.raises(error, match=needle):
        convert.to_generation_request(req, FACTS)


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "limit", "needle"),
    [
        ([50], None, 0, "prompt_token_ids\\[0\\] = 50 .* 0..49"),
        ([1] * 100, None, 0, "max_model_len 100"),
        ([1] * 90, 11, 0, "at most 10 tokens"),
        ([1] * 9, None, 8, "at most 8 \\(--max-prompt-tokens\\)"),
        ([], None, 0, "empty"),
    ],
)
def test_prompt_checks(prompt: list[int], max_tokens: int | None, limit: int, needle: str) -> None:
    with pytest.raises(InvalidRequest, match=needle):
        check_prompt(prompt, max_tokens, FACTS, max_prompt_tokens=limit)
    check_prompt([1] * 89, 11, FACTS, max_prompt_tokens=89)  # exactly fits: no error


def test_stream_message_final_fields() -> None:
    step = EngineStep(
        token_ids=[0, 7],
        text="ab",
        finished=True,
        finish_reason="stop",
        stop_reason="b",
        prompt_tokens=3,
        completion_tokens=9,
        cached_tokens=2,
        logprobs=[TokenLogprob(0, -0.1, ((0, -0.1),)), TokenLogprob(7, -1.0)],
    )
    message = responses.stream_message("r", step, pb.WorkerMetrics(running_requests=4))
    assert list(message.token_ids) == [0, 7] and message.text_delta == "ab"
    assert message.is_finished and message.finish_reason == "stop" and message.stop_str == "b"
    assert (message.usage.prompt_tokens, message.usage.completion_tokens) == (3, 9)
    assert message.usage.cached_tokens == 2 and message.metrics.running_requests == 4
    assert [lp.token_id for lp in message.logprobs] == [0, 7]
    no_metrics = responses.stream_message("r", step, None)
    assert not no_metrics.HasField("metrics")


def test_unary_accumulator_joins_steps() -> None:
    acc = RequestResult()
    acc.add(EngineStep([1, 2], "x", False, prompt_tokens=1, completion_tokens=2))
    acc.add(EngineStep([2], "y", True, "stop", 2, prompt_tokens=1, completion_tokens=3))
    response = responses.unary_response("r", acc, None)
    assert list(response.output_token_ids) == [1, 2, 2] and response.output_text == "xy"
    assert response.stop_token_id == 2 and response.usage.completion_tokens == 3


# -- the vLLM adapter's conversions (need vLLM importable, not a running engine) ------------------


def _vllm() -> None:
    require(importlib.util.find_spec("vllm") is not None, "vLLM is not installed")


def test_unset_fields_take_model_defaults_then_vllm_neutral_values() -> None:
    _vllm()
    from vllm_router.engine.vllm.params import build_sampling_params

    params = build_sampling_params(
        SamplingOptions(top_p=0.5),
        model_defaults={"temperature": 0.3, "top_p": 0.9, "top_k": 7},
        prompt_len=10,
        max_model_len=100,
        detokenize=True,
    )
    assert params.temperature == pytest.approx(0.3)  # model default
    assert params.top_p == pytest.approx(0.5)  # client value wins
    assert params.top_k == 7
    assert params.min_p == 0.0 and params.repetition_penalty == 1.0  # vLLM neutral
    assert params.max_tokens == 90  # what the context leaves


def test_set_fields_override_and_max_tokens_default_is_capped() -> None:
    _vllm()
    from vllm.sampling_params import RequestOutputKind

    from vllm_router.engine.vllm.params import build_sampling_params

    params = build_sampling_params(
        SamplingOptions(temperature=0.0, stop=("x",), stop_token_ids=(5,), logprobs=3),
        model_defaults={"temperature": 0.3, "max_tokens": 20},
        prompt_len=10,
        max_model_len=100,
        detokenize=True,
    )
    assert params.temperature == 0.0
    assert params.max_tokens == 20
    assert params.stop == ["x"] and params.stop_token_ids == [5] and params.logprobs == 3
    assert params.output_kind == RequestOutputKind.DELTA
    with pytest.raises(Exception, match="top_p"):
        build_sampling_params(
            SamplingOptions(top_p=0.0),
            model_defaults={},
            prompt_len=1,
            max_model_len=10,
            detokenize=True,
        )


def test_vllm_exceptions_map_to_servicer_errors() -> None:
    _vllm()
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError

    from vllm_router.engine.vllm.params import translate_error as _translate
    from vllm_router.errors import EngineUnavailable

    assert isinstance(_translate(EngineDeadError()), EngineUnavailable)
    assert isinstance(_translate(VLLMValidationError("bad top_p")), InvalidRequest)
    wrapped = EngineGenerateError()
    wrapped.__cause__ = ValueError("Token id 99 is out of vocabulary")
    translated = _translate(wrapped)
    assert isinstance(translated, InvalidRequest) and "99" in str(translated)
    other = RuntimeError("boom")
    assert _translate(other) is other


def _set_fields(options: SamplingOptions) -> list[tuple[str, object]]:
    return [(k, v) for k, v in dataclasses.asdict(options).items() if v not in (None, ())]


MOCK_RULE_CASES = [
    SamplingOptions(temperature=math.nan),
    SamplingOptions(temperature=math.inf),
    SamplingOptions(temperature=-1.0),
    SamplingOptions(temperature=2.5),
    SamplingOptions(temperature=2.0),
    SamplingOptions(temperature=0.0),
    SamplingOptions(top_p=0.0),
    SamplingOptions(top_p=1.5),
    SamplingOptions(top_p=math.nan),
    SamplingOptions(top_p=1.0),
    SamplingOptions(top_k=-2),
    SamplingOptions(top_k=-1),
    SamplingOptions(top_k=0),
    SamplingOptions(top_k=7),
    SamplingOptions(min_p=1.5),
    SamplingOptions(min_p=-0.1),
    SamplingOptions(min_p=math.nan),
    SamplingOptions(min_p=1.0),
    SamplingOptions(max_tokens=0),
    SamplingOptions(max_tokens=2, min_tokens=3),
    SamplingOptions(max_tokens=3, min_tokens=3),
    SamplingOptions(frequency_penalty=3.0),
    SamplingOptions(frequency_penalty=math.nan),
    SamplingOptions(frequency_penalty=-2.0),
    SamplingOptions(presence_penalty=-3.0),
    SamplingOptions(presence_penalty=math.inf),
    SamplingOptions(repetition_penalty=0.0),
    SamplingOptions(repetition_penalty=math.inf),
    SamplingOptions(repetition_penalty=-1.0),
    SamplingOptions(repetition_penalty=1.3),
    SamplingOptions(stream_interval=0),
    SamplingOptions(stream_interval=4),
]


@pytest.mark.parametrize(
    "options", MOCK_RULE_CASES, ids=lambda o: ",".join(f"{k}={v}" for k, v in _set_fields(o))
)
def test_the_mock_rejects_exactly_what_vllm_rejects(options: SamplingOptions) -> None:
    _vllm()
    from vllm.exceptions import VLLMClientError

    from vllm_router.engine.vllm.params import build_sampling_params
    from vllm_router.testing.mock_sampling import validate_sampling

    def rejects(check: Callable[[], object]) -> bool:
        try:
            check()
        except (ValueError, VLLMClientError, InvalidRequest):
            return True
        return False

    vllm_rejects = rejects(
        lambda: build_sampling_params(
            options, model_defaults={}, prompt_len=1, max_model_len=4096, detokenize=True
        )
    )
    assert rejects(lambda: validate_sampling(options, detokenize=True)) == vllm_rejects


def test_unary_response_with_n_samples() -> None:
    acc = RequestResult()
    acc.add(EngineStep([5], "a", False, prompt_tokens=2, completion_tokens=1, index=1))
    acc.add(EngineStep([7], "b", True, "length", prompt_tokens=2, completion_tokens=1, index=0))
    acc.add(EngineStep([6], "c", True, "stop", 6, prompt_tokens=2, completion_tokens=2, index=1))
    response = responses.unary_response("r", acc, None)
    # Top-level fields are sample 0; usage counts every sample's tokens.
    assert (list(response.output_token_ids), response.finish_reason) == ([7], "length")
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (2, 3)
    assert [(s.index, list(s.output_token_ids), s.output_text) for s in response.samples] == [
        (0, [7], "b"),
        (1, [5, 6], "ac"),
    ]
    assert (response.samples[1].finish_reason, response.samples[1].stop_token_id) == ("stop", 6)
    single = RequestResult()
    single.add(EngineStep([7], "b", True, "length", prompt_tokens=2, completion_tokens=1))
    assert (
        len(responses.unary_response("r", single, None).samples) == 0
    )  # n = 1: no duplicate sample list


def test_tokenizer_chunks_and_digest() -> None:
    import hashlib

    files = [("a.json", b"x" * (responses.TOKENIZER_CHUNK_BYTES + 5)), ("b.txt", b"")]
    chunks = list(responses.tokenizer_chunks(files, tokenizer_digest(files)))
    assert [(c.file_name, len(c.data)) for c in chunks[:-1]] == [
        ("a.json", responses.TOKENIZER_CHUNK_BYTES),
        ("a.json", 5),
        ("b.txt", 0),
    ]
    expected = hashlib.sha256()
    for name, data in files:
        expected.update(name.encode() + b"\0" + len(data).to_bytes(8, "big") + data)
    assert (chunks[-1].sha256, chunks[-1].file_count) == (expected.hexdigest(), 2)
