"""vllm.engine.v1 messages <-> the neutral engine types, and request validation.

Pure functions: no I/O, no server, no vLLM import, so each rule is testable on its
own. Sampling fields are converted by name from the one declaration
(`engine.SamplingOptions`); value ranges are the engine's to judge (vLLM's own
messages reach the client). Prompt checks that need the model's facts run at
admission (`serving.prompts`), after a text prompt has been tokenized.
"""

from __future__ import annotations

import dataclasses
import uuid

from .engine import (
    EngineStep,
    GenerationRequest,
    LoadSnapshot,
    ModelFacts,
    SamplingOptions,
    TokenLogprob,
)
from .errors import InvalidRequest, Unsupported
from .proto import vllm_engine_pb2 as pb

# A request id is echoed on every message and kept in the request table.
MAX_REQUEST_ID_BYTES = 256
MAX_STOP_STRINGS = 128
MAX_STOP_STRING_CHARS = 1024

_SAMPLING_PROTO_FIELDS = pb.SamplingParams.DESCRIPTOR.fields_by_name
# (name, repeated?) for every SamplingOptions field this contract carries.
_SAMPLING_FIELDS = tuple(
    (f.name, _SAMPLING_PROTO_FIELDS[f.name].is_repeated)
    for f in dataclasses.fields(SamplingOptions)
    if f.name in _SAMPLING_PROTO_FIELDS
)
_EXECUTION_MODES = {v.number: v.name for v in pb.ExecutionMode.DESCRIPTOR.values}


def new_request_id() -> str:
    return uuid.uuid4().hex


def to_generation_request(request: pb.GenerateRequest, facts: ModelFacts) -> GenerationRequest:
    """Validate the fields of a GenerateRequest and turn it into an engine request."""
    request_id = request.request_id or new_request_id()
    if len(request_id.encode()) > MAX_REQUEST_ID_BYTES:
        raise InvalidRequest(
            f"request_id is {len(request_id.encode())} bytes; at most "
            f"{MAX_REQUEST_ID_BYTES} are allowed"
        )
    mode = request.execution_mode
    if mode != pb.EXECUTION_MODE_NORMAL:
        if mode not in _EXECUTION_MODES:
            raise InvalidRequest(f"execution_mode {mode} is not a known ExecutionMode value")
        raise Unsupported(
            f"execution_mode {_EXECUTION_MODES[mode]} is not implemented; "
            "only EXECUTION_MODE_NORMAL is served"
        )
    if request.multimodal_data:
        raise Unsupported(
            f"multimodal_data is not implemented ({len(request.multimodal_data)} item(s) sent); "
            "send a text-only prompt"
        )
    dp_rank = request.dp_rank if request.HasField("dp_rank") else None
    if dp_rank is not None and dp_rank >= facts.dp_size:
        raise InvalidRequest(
            f"dp_rank {dp_rank} is out of range: this engine has dp_size "
            f"{facts.dp_size} (valid ranks 0..{facts.dp_size - 1})"
        )
    if request.prompt_token_ids:
        prompt_ids, prompt_text = list(request.prompt_token_ids), None
    elif request.prompt_text:
        prompt_ids, prompt_text = None, request.prompt_text
    else:
        raise InvalidRequest("the prompt is empty: set prompt_token_ids (or prompt_text)")
    return GenerationRequest(
        request_id=request_id,
        prompt_token_ids=prompt_ids,
        prompt_text=prompt_text,
        sampling=to_sampling_options(request.sampling_params),
        dp_rank=dp_rank,
        detokenize=not request.skip_detokenize,
    )


def to_sampling_options(params: pb.SamplingParams) -> SamplingOptions:
    values: dict[str, object] = {}
    for name, repeated in _SAMPLING_FIELDS:
        if repeated:
            values[name] = tuple(getattr(params, name))
        elif params.HasField(name):
            values[name] = getattr(params, name)
    _check_stop_strings(params.stop)
    return SamplingOptions(**values)  # type: ignore[arg-type]


def _check_stop_strings(stops: list[str]) -> None:
    if len(stops) > MAX_STOP_STRINGS:
        raise InvalidRequest(
            f"sampling_params.stop has {len(stops)} strings; at most {MAX_STOP_STRINGS}"
        )
    for i, stop in enumerate(stops):
        if not stop:
            raise InvalidRequest(
                f"sampling_params.stop[{i}] is empty; stop strings must be non-empty"
            )
        if len(stop) > MAX_STOP_STRING_CHARS:
            raise InvalidRequest(
                f"sampling_params.stop[{i}] has {len(stop)} characters; at most "
                f"{MAX_STOP_STRING_CHARS}"
            )


# -- engine -> proto -----------------------------------------------------------------------------


def worker_metrics(load: LoadSnapshot) -> pb.WorkerMetrics:
    return pb.WorkerMetrics(
        running_requests=load.running_requests,
        waiting_requests=load.waiting_requests,
        kv_cache_usage_percent=load.kv_cache_usage * 100.0,
    )


def _usage(step: EngineStep) -> pb.Usage:
    return pb.Usage(
        prompt_tokens=step.prompt_tokens,
        completion_tokens=step.completion_tokens,
        cached_tokens=step.cached_tokens,
    )


def _logprobs(entries: list[TokenLogprob]) -> list[pb.TokenLogprob]:
    return [
        pb.TokenLogprob(
            token_id=e.token_id,
            logprob=e.logprob,
            top_logprobs=[pb.TopLogprob(token_id=t, logprob=lp) for t, lp in e.top],
        )
        for e in entries
    ]


def _set_matched_stop(
    message: pb.GenerateStreamResponse | pb.GenerateResponse, step: EngineStep
) -> None:
    if isinstance(step.stop_reason, str):
        message.stop_str = step.stop_reason
    elif step.stop_reason is not None:
        message.stop_token_id = step.stop_reason


def stream_message(
    request_id: str, step: EngineStep, metrics: pb.WorkerMetrics | None
) -> pb.GenerateStreamResponse:
    message = pb.GenerateStreamResponse(
        request_id=request_id,
        token_ids=step.token_ids,
        text_delta=step.text,
        usage=_usage(step),
        metrics=metrics,
    )
    if step.logprobs is not None:
        message.logprobs.extend(_logprobs(step.logprobs))
    if step.finished:
        message.is_finished = True
        message.finish_reason = step.finish_reason or ""
        _set_matched_stop(message, step)
    return message


class UnaryAccumulator:
    """Collects the steps of one request into a GenerateResponse."""

    __slots__ = ("_last", "_logprobs", "_text", "_token_ids")

    def __init__(self) -> None:
        self._token_ids: list[int] = []
        self._text: list[str] = []
        self._logprobs: list[TokenLogprob] | None = None
        self._last: EngineStep | None = None

    def add(self, step: EngineStep) -> None:
        self._token_ids.extend(step.token_ids)
        if step.text:
            self._text.append(step.text)
        if step.logprobs is not None:
            if self._logprobs is None:
                self._logprobs = []
            self._logprobs.extend(step.logprobs)
        self._last = step

    def response(self, request_id: str, metrics: pb.WorkerMetrics | None) -> pb.GenerateResponse:
        last = self._last
        message = pb.GenerateResponse(
            request_id=request_id,
            output_token_ids=self._token_ids,
            output_text="".join(self._text),
            metrics=metrics,
        )
        if last is not None:
            message.finish_reason = last.finish_reason or ""
            message.usage.CopyFrom(_usage(last))
            _set_matched_stop(message, last)
        if self._logprobs is not None:
            message.logprobs.extend(_logprobs(self._logprobs))
        return message


def model_info(facts: ModelFacts) -> pb.GetModelInfoResponse:
    return pb.GetModelInfoResponse(
        model_name=facts.model_name,
        served_model_name=facts.served_model_name,
        max_model_len=facts.max_model_len,
        vocab_size=facts.vocab_size,
        dp_size=facts.dp_size,
        block_size=facts.block_size,
        eos_token_ids=facts.eos_token_ids,
        engine=facts.engine,
        engine_version=facts.engine_version,
    )
