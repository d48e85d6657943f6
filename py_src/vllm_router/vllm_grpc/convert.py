"""vllm.grpc.engine requests -> the neutral engine types (pure functions).

Semantics follow vLLM's own `--grpc` server, which the router was written against:
every sampling field is explicit (an unset temperature is 1.0, a zero top_p or
repetition_penalty means 1.0, n 0 means 1) — the router applies the model's
generation defaults itself, from GetModelInfo — and text is produced only when stop
strings need it (the contract carries token ids, not text).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

from ..convert import checked_request_id
from ..engine import GenerationRequest, ModelFacts, SamplingOptions, StructuredOutputs
from ..errors import InvalidRequest, Unsupported

_CONSTRAINTS = {  # proto oneof member -> StructuredOutputs field
    "json_schema": "json",
    "regex": "regex",
    "grammar": "grammar",
    "structural_tag": "structural_tag",
    "json_object": "json_object",
    "choice": "choice",
}


def sampling_options(params: vpb.SamplingParams) -> SamplingOptions:
    constraint = params.WhichOneof("constraint")
    structured = None
    if constraint is not None:
        value: Any = getattr(params, constraint)
        if constraint == "choice":
            value = tuple(value.choices)
        structured = StructuredOutputs(**{_CONSTRAINTS[constraint]: value})
    if params.grammar_from_first_token:
        raise Unsupported(
            "sampling_params.grammar_from_first_token is not implemented (no reasoning parser "
            "runs in this worker): the constraint applies from the first token"
        )
    return SamplingOptions(
        temperature=params.temperature if params.HasField("temperature") else 1.0,
        top_p=params.top_p or 1.0,
        top_k=params.top_k,
        min_p=params.min_p,
        frequency_penalty=params.frequency_penalty,
        presence_penalty=params.presence_penalty,
        repetition_penalty=params.repetition_penalty or 1.0,
        max_tokens=params.max_tokens if params.HasField("max_tokens") else None,
        min_tokens=params.min_tokens,
        seed=params.seed if params.HasField("seed") else None,
        ignore_eos=params.ignore_eos,
        skip_special_tokens=params.skip_special_tokens,
        spaces_between_special_tokens=params.spaces_between_special_tokens,
        include_stop_str_in_output=params.include_stop_str_in_output,
        stop=tuple(params.stop),
        stop_token_ids=tuple(params.stop_token_ids),
        logprobs=params.logprobs if params.HasField("logprobs") else None,
        prompt_logprobs=params.prompt_logprobs if params.HasField("prompt_logprobs") else None,
        n=params.n or 1,
        logit_bias=dict(params.logit_bias) or None,
        structured_outputs=structured,
    )


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
    source = request.WhichOneof("input")
    ids: list[int] | None = None
    text: str | None = None
    if source == "tokenized" and request.tokenized.input_ids:
        ids = _truncated(list(request.tokenized.input_ids), params, facts)
    elif source == "text" and request.text:
        text = request.text
    else:
        raise InvalidRequest("the prompt is empty: set tokenized.input_ids (or text)")
    dp_rank = request.data_parallel_rank if request.HasField("data_parallel_rank") else None
    if dp_rank is not None and not 0 <= dp_rank < facts.dp_size:
        raise InvalidRequest(
            f"data_parallel_rank {dp_rank} is out of range: this engine has data_parallel_size "
            f"{facts.dp_size} (valid ranks 0..{facts.dp_size - 1})"
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
    )
