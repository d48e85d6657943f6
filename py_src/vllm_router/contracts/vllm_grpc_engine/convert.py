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

from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

from ...core.media_admission import checked_tensor
from ...core.request_fields import checked_dp_rank, checked_request_id
from ...core.sampling import SamplingTable
from ...engine import (
    GenerationRequest,
    MediaItem,
    ModelFacts,
    ProcessedMedia,
    RawTensor,
    SamplingOptions,
    StructuredOutputs,
)
from ...engine.media_types import TensorLayout
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


_MODALITIES = {
    common_pb2.IMAGE: "image",
    common_pb2.VIDEO: "video",
    common_pb2.AUDIO: "audio",
}


def _tensor(data: Any, where: str) -> RawTensor:
    payload = data.WhichOneof("payload")
    if payload != "inline":
        # This worker advertises no shm namespace, so a router sends tensors inline.
        raise Unsupported(
            f"{where}: a {payload or 'missing'} tensor payload is not served; send the bytes inline"
        )
    return checked_tensor(data.dtype, list(data.shape), data.inline, where)


def _batch(batch: Any, where: str) -> ProcessedMedia:
    """One MultimodalInputs (a router's processor outputs for items of one modality)."""
    modality = _MODALITIES.get(batch.modality or 1)
    if modality is None:
        raise InvalidRequest(f"{where}.modality {batch.modality} is not a known modality")
    primary = batch.encoder_input_key if batch.HasField("encoder_input_key") else "pixel_values"
    tensors = {
        name: _tensor(value, f"{where}.model_specific_tensors[{name}]")
        for name, value in batch.model_specific_tensors.items()
    }
    if batch.HasField("pixel_values"):
        tensors[primary] = _tensor(batch.pixel_values, f"{where}.pixel_values")
    if not tensors:
        raise Unsupported(
            f"{where} carries no tensors (a pixel-less leg of a disaggregated request); "
            "this worker needs the processor outputs"
        )
    layout: dict[str, TensorLayout] = {key: "batched" for key in batch.batched_keys}
    layout.update({key: ("flat", sizes) for key, sizes in batch.flat_keys.items()})
    return ProcessedMedia(
        modality=modality,
        tensors=tensors,
        placeholders=tuple((p.offset, p.length) for p in batch.mm_placeholders),
        hashes=tuple(batch.mm_hashes),
        layout=layout,
        embed_token_id=batch.im_token_id if batch.HasField("im_token_id") else None,
    )


def _media(request: vpb.GenerateRequest) -> dict[str, Any]:
    """mm_inputs + extra_mm_inputs (processed) or media_refs (URLs) -> the request's media."""
    batches = [request.mm_inputs] if request.HasField("mm_inputs") else []
    batches += list(request.extra_mm_inputs)
    has_refs = request.HasField("media_refs")
    if not batches and not has_refs:
        return {}
    if request.WhichOneof("input") != "tokenized":
        raise InvalidRequest("multimodal inputs need a tokenized prompt (tokenized.input_ids)")
    if batches and has_refs:
        raise InvalidRequest("media_refs cannot be combined with mm_inputs / extra_mm_inputs")
    if batches:
        names = ["mm_inputs"] if request.HasField("mm_inputs") else []
        names += [f"extra_mm_inputs[{i}]" for i in range(len(request.extra_mm_inputs))]
        return {
            "processed_media": tuple(_batch(b, n) for b, n in zip(batches, names, strict=True)),
            "media_field": "mm_inputs",
        }
    refs = request.media_refs.items
    if not refs:
        raise InvalidRequest("media_refs is set but carries no items")
    media = []
    for i, ref in enumerate(refs):
        modality = _MODALITIES.get(ref.modality)
        if modality is None:
            known = ref.modality in common_pb2.Modality.values()
            name = common_pb2.Modality.Name(ref.modality) if known else str(ref.modality)
            raise InvalidRequest(
                f"media_refs[{i}]: modality {name} is not supported (IMAGE, VIDEO or AUDIO)"
            )
        if not ref.url:
            raise InvalidRequest(f"media_refs[{i}]: the url is empty")
        media.append(MediaItem(modality, url=ref.url))
    return {"media": tuple(media), "media_field": "media_refs"}


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
        **_media(request),
    )
