"""vllm.engine.v1 requests -> the neutral engine types, with request validation.

Pure functions: no I/O, no server, no vLLM import, so each rule is testable on its
own. Sampling fields are converted by name from the one declaration
(`engine.SamplingOptions`); value ranges are the engine's to judge (vLLM's own
messages reach the client). Prompt checks that need the model's facts run at
admission (`serving.prompts`), after a text prompt has been tokenized.
Responses are built in `responses.py`.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .engine import GenerationRequest, ModelFacts, SamplingOptions, StructuredOutputs
from .errors import InvalidRequest, Unsupported
from .proto import vllm_engine_pb2 as pb

# A request id is echoed on every message and kept in the request table.
MAX_REQUEST_ID_BYTES = 256
MAX_STOP_STRINGS = 128
MAX_STOP_STRING_CHARS = 1024

# Metadata keys whose values reach the engine as W3C trace context.
TRACE_HEADERS = ("traceparent", "tracestate")


def _structured_outputs(params: pb.SamplingParams) -> StructuredOutputs | None:
    if not params.HasField("structured_outputs"):
        return None
    so = params.structured_outputs
    kind = so.WhichOneof("constraint")
    if kind is None:
        raise InvalidRequest(
            "sampling_params.structured_outputs sets no constraint: set one of json, regex, "
            "grammar, choice, json_object, structural_tag"
        )
    value: Any = getattr(so, kind)
    if kind == "choice":
        value = tuple(value.choices)
        if not value:
            raise InvalidRequest("sampling_params.structured_outputs.choice has no choices")
    return StructuredOutputs(
        **{kind: value},
        disable_any_whitespace=so.disable_any_whitespace,
        disable_additional_properties=so.disable_additional_properties,
        whitespace_pattern=so.whitespace_pattern or None,
    )


# Fields whose proto form is not a scalar or a plain repeated scalar.
_SPECIAL: dict[str, Callable[[pb.SamplingParams], Any]] = {
    "logit_bias": lambda params: dict(params.logit_bias) or None,
    "structured_outputs": _structured_outputs,
}
_SAMPLING_PROTO_FIELDS = pb.SamplingParams.DESCRIPTOR.fields_by_name
# (name, repeated?) for every other SamplingOptions field this contract carries.
_SAMPLING_FIELDS = tuple(
    (f.name, _SAMPLING_PROTO_FIELDS[f.name].is_repeated)
    for f in dataclasses.fields(SamplingOptions)
    if f.name in _SAMPLING_PROTO_FIELDS and f.name not in _SPECIAL
)
_EXECUTION_MODES = {v.number: v.name for v in pb.ExecutionMode.DESCRIPTOR.values}


def new_request_id() -> str:
    return uuid.uuid4().hex


def trace_headers(metadata: Sequence[tuple[str, str | bytes]] | None) -> dict[str, str] | None:
    """The W3C trace context in a call's metadata, if any."""
    found = {
        key: value if isinstance(value, str) else value.decode(errors="replace")
        for key, value in metadata or ()
        if key in TRACE_HEADERS
    }
    return found or None


def checked_request_id(request_id: str) -> str:
    """The caller's id (or a new one when empty), within the length limit."""
    request_id = request_id or new_request_id()
    if len(request_id.encode()) > MAX_REQUEST_ID_BYTES:
        raise InvalidRequest(
            f"request_id is {len(request_id.encode())} bytes; at most "
            f"{MAX_REQUEST_ID_BYTES} are allowed"
        )
    return request_id


def to_generation_request(
    request: pb.GenerateRequest,
    facts: ModelFacts,
    trace: Mapping[str, str] | None = None,
) -> GenerationRequest:
    """Validate the fields of a GenerateRequest and turn it into an engine request."""
    request_id = checked_request_id(request.request_id)
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
    if request.priority and not facts.supports_priority:
        raise InvalidRequest(
            f"priority {request.priority} needs an engine started with "
            "--scheduling-policy priority; this one schedules first come, first served"
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
        lora_name=request.lora_name or None,
        priority=request.priority,
        trace_headers=trace,
    )


def to_sampling_options(params: pb.SamplingParams) -> SamplingOptions:
    values: dict[str, object] = {}
    for name, repeated in _SAMPLING_FIELDS:
        if repeated:
            values[name] = tuple(getattr(params, name))
        elif params.HasField(name):
            values[name] = getattr(params, name)
    for name, convert in _SPECIAL.items():
        values[name] = convert(params)
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
