"""Pure conversion functions, no server."""

from __future__ import annotations

import importlib.util

import pytest

from vllm_router import convert
from vllm_router.engine import EngineStep, ModelFacts, SamplingOptions, TokenLogprob
from vllm_router.errors import InvalidRequest, Unsupported
from vllm_router.proto import vllm_engine_pb2 as pb

from conftest import require

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
        (pb.GenerateRequest(prompt_token_ids=[50]), InvalidRequest, "0..49"),
        (pb.GenerateRequest(prompt_token_ids=[1] * 100), InvalidRequest, "max_model_len 100"),
        (
            pb.GenerateRequest(
                prompt_token_ids=[1] * 90, sampling_params=pb.SamplingParams(max_tokens=11)
            ),
            InvalidRequest,
            "at most 10 tokens",
        ),
        (pb.GenerateRequest(prompt_token_ids=[1], dp_rank=2), InvalidRequest, "0..1"),
        (pb.GenerateRequest(prompt_token_ids=[1], execution_mode=1), Unsupported, "PREFILL"),
    ],
)
def test_validation(req: pb.GenerateRequest, error: type[Exception], needle: str) -> None:
    with pytest.raises(error, match=needle):
        convert.to_generation_request(req, FACTS)


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
    message = convert.stream_message("r", step, pb.WorkerMetrics(running_requests=4))
    assert list(message.token_ids) == [0, 7] and message.text_delta == "ab"
    assert message.is_finished and message.finish_reason == "stop" and message.stop_str == "b"
    assert (message.usage.prompt_tokens, message.usage.completion_tokens) == (3, 9)
    assert message.usage.cached_tokens == 2 and message.metrics.running_requests == 4
    assert [lp.token_id for lp in message.logprobs] == [0, 7]
    no_metrics = convert.stream_message("r", step, None)
    assert not no_metrics.HasField("metrics")


def test_unary_accumulator_joins_steps() -> None:
    acc = convert.UnaryAccumulator()
    acc.add(EngineStep([1, 2], "x", False, prompt_tokens=1, completion_tokens=2))
    acc.add(EngineStep([2], "y", True, "stop", 2, prompt_tokens=1, completion_tokens=3))
    response = acc.response("r", None)
    assert list(response.output_token_ids) == [1, 2, 2] and response.output_text == "xy"
    assert response.stop_token_id == 2 and response.usage.completion_tokens == 3


# -- the vLLM adapter's conversions (need vLLM importable, not a running engine) ------------------


def _vllm() -> None:
    require(importlib.util.find_spec("vllm") is not None, "vLLM is not installed")


def test_unset_fields_take_model_defaults_then_vllm_neutral_values() -> None:
    _vllm()
    from vllm_router.vllm_engine import build_sampling_params

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

    from vllm_router.vllm_engine import build_sampling_params

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

    from vllm_router.errors import EngineUnavailable
    from vllm_router.vllm_engine import _translate

    assert isinstance(_translate(EngineDeadError()), EngineUnavailable)
    assert isinstance(_translate(VLLMValidationError("bad top_p")), InvalidRequest)
    wrapped = EngineGenerateError()
    wrapped.__cause__ = ValueError("Token id 99 is out of vocabulary")
    translated = _translate(wrapped)
    assert isinstance(translated, InvalidRequest) and "99" in str(translated)
    other = RuntimeError("boom")
    assert _translate(other) is other
