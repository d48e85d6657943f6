"""vllm.grpc.engine requests -> the neutral engine types (pure functions).

Semantics follow vLLM's own `--grpc` server, which the router was written against:
every sampling field is explicit (an unset temperature is 1.0, a zero top_p or
repetition_penalty means 1.0, n 0 means 1) — the router applies the model's
generation defaults itself, from GetModelInfo —, text is produced only when stop
strings need it (the contract carries token ids, not text), a max_tokens past the
context generates until the context is full (finish "length"), and a request wrong in
both its sampling values and its prompt is told about the sampling values.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

from ...core.request_fields import checked_dp_rank, checked_request_id
from ...core.sampling import SamplingTable
from ...engine import GenerationRequest, ModelFacts, SamplingOptions, StructuredOutputs
from ...errors import InvalidRequest, Unsupported

_CONSTRAINTS = {  # proto oneof member -> StructuredOutputs field
    "json_schema": "json",
    "regex": "regex",
    "grammar": "grammar",
    "structural_tag": "structural_tag",
    "json_object": "json_object",
    "choice": "choice",
}


def _structured_outputs(params: vpb.SamplingParams) -> StructuredOutputs | None:
    constraint = params.WhichOneof("constraint")
    if constraint is None:
        return None
    value: Any = getattr(params, constraint)
    if constraint == "choice":
        value = tuple(value.choices)
    return StructuredOutputs(**{_CONSTRAINTS[constraint]: value})


SAMPLING = SamplingTable(
    vpb.SamplingParams.DESCRIPTOR,
    special={"structured_outputs": _structured_outputs},
    # What vLLM's --grpc server reads for an unset temperature and a zero top_p,
    # repetition_penalty or n: the neutral value, not the model's default.
    fallbacks={"temperature": 1.0, "top_p": 1.0, "repetition_penalty": 1.0, "n": 1},
)
# Proto fields read outside the table: by the request conversion below, or refused.
HANDLED_ELSEWHERE = frozenset({*_CONSTRAINTS, "truncate_prompt_tokens", "grammar_from_first_token"})


def sampling_options(params: vpb.SamplingParams) -> SamplingOptions:
    if params.grammar_from_first_token:
        raise Unsupported(
            "sampling_params.grammar_from_first_token is not implemented (no reasoning parser "
            "runs in this worker): the constraint applies from the first token"
        )
    return SAMPLING.read(params)


def kv_transfer_params(request: vpb.GenerateRequest) -> Mapping[str, Any] | None:
    """The KV connector's parameters: the JSON form wins over the structured one."""
    if request.HasField("kv_transfer_params_json"):
        try:
            parsed = json.loads(request.kv_transfer_params_json)
        except json.JSONDecodeError as exc:
            raise InvalidRequest(f"kv_transfer_params_json is not JSON: {exc}") from exc
        if not isinstance(parsed, dict):
            raise InvalidRequest("kv_transfer_params_json must be a JSON object")
        return parsed
    if request.HasField("kv_transfer_params"):
        kv = request.kv_transfer_params
        return {"remote_host": kv.remote_host, "remote_port": kv.remote_port}
    return None


def _refuse_media(request: vpb.GenerateRequest) -> None:
    sent = [name for name in ("mm_inputs", "media_refs") if request.HasField(name)] + (
        ["extra_mm_inputs"] if len(request.extra_mm_inputs) else []
    )
    if sent:
        raise Unsupported(
            f"multimodal inputs are not implemented by this worker ({', '.join(sent)} sent); "
            "send a text-only prompt"
        )


def _truncated(ids: list[int], params: vpb.SamplingParams, facts: ModelFacts) -> list[int]:
    """truncate_prompt_tokens keeps the last N prompt tokens (-1: the model's context)."""
    if not params.HasField("truncate_prompt_tokens"):
        return ids
    keep = params.truncate_prompt_tokens
    if keep == -1:
        keep = facts.max_model_len
    if keep < 1:
        raise InvalidRequest(f"truncate_prompt_tokens must be -1 or >= 1, got {keep}")
    return ids[-keep:]


def to_generation_request(
    request: vpb.GenerateRequest, facts: ModelFacts, trace: Mapping[str, str] | None
) -> GenerationRequest:
    _refuse_media(request)
    params = request.sampling_params
    ids: list[int] | None = None
    text: str | None = None
    if request.WhichOneof("input") == "text" and request.text:
        text = request.text
    else:
        # An empty prompt is refused at admission, after the sampling values are checked:
        # vLLM's server names a sampling error first.
        ids = _truncated(list(request.tokenized.input_ids), params, facts)
    dp_rank = checked_dp_rank(
        request.data_parallel_rank if request.HasField("data_parallel_rank") else None,
        facts,
        "data_parallel_rank",
    )
    sampling = sampling_options(params)
    return GenerationRequest(
        request_id=checked_request_id(request.request_id),
        prompt_token_ids=ids,
        prompt_text=text,
        sampling=sampling,
        dp_rank=dp_rank,
        # Token ids out; text only where stop strings need it, as vLLM's --grpc server.
        detokenize=bool(sampling.stop),
        trace_headers=trace,
        kv_transfer_params=kv_transfer_params(request),
        # As vLLM's --grpc server: a max_tokens past the context generates until it is full.
        fill_context=True,
        prompt_field="tokenized.input_ids",
    )
