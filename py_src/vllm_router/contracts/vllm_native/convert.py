"""vllm.Inference requests -> the neutral engine types (pure functions).

Semantics follow vllm-rs, the server this contract comes from: an unset temperature is
the model's generation-config default (else 1.0), zeros stand for "unset" where vLLM
has no zero (top_p and repetition_penalty 1.0, num_sequences 1, top_k off),
`max_new_tokens` 0 generates until the context is full (the router sends 0 when its
client set no maximum), text is produced unless `response.output_text` is false, and
the data-parallel rank comes from the `x-data-parallel-rank` call metadata.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from google.protobuf import json_format

from ...core.request_fields import checked_dp_rank, checked_request_id
from ...engine import GenerationRequest, MediaItem, ModelFacts, SamplingOptions, StructuredOutputs
from ...errors import InvalidRequest, NotFound, Unsupported
from ...proto import vllm_native_pb2 as npb

DP_RANK_KEY = "x-data-parallel-rank"

# DecodingParameters' structured_output member -> StructuredOutputs field.
_CONSTRAINTS = {
    "json": "json",
    "regex": "regex",
    "grammar": "grammar",
    "structural_tag": "structural_tag",
    "json_object": "json_object",
    "choice": "choice",
}
_MODALITIES = {
    npb.MODALITY_IMAGE: "image",
    npb.MODALITY_VIDEO: "video",
    npb.MODALITY_AUDIO: "audio",
}

# Request fields this worker cannot honour: refused with the reason when set.
_REFUSED = {
    "session_id": "sessions are not served by this worker",
    "watermarking": "watermarking is not served by this worker",
    "kv_hints": "KV hints are not served by this worker",
    "engine_reasoning_gate": "no reasoning parser runs in this worker",
}


def _refuse_unserved(request: npb.GenerateRequest) -> None:
    for name, why in _REFUSED.items():
        # watermarking false asks for nothing.
        if request.HasField(name) and (name != "watermarking" or request.watermarking):
            raise Unsupported(f"{name} is set: {why}")
    if request.stopping.HasField("thinking_token_budget"):
        raise Unsupported(
            "stopping.thinking_token_budget is set: no reasoning parser runs in this worker"
        )
    if request.decoding.bad_words_token_ids:
        raise Unsupported(
            "decoding.bad_words_token_ids is not served: vLLM's AsyncLLM takes bad words as "
            "text only"
        )
    if request.kv.HasField("ec_transfer_params"):
        raise Unsupported("kv.ec_transfer_params is set: no encoder-cache connector runs here")


def _structured_outputs(decoding: npb.DecodingParameters) -> StructuredOutputs | None:
    member = decoding.WhichOneof("structured_output")
    if member is None:
        return None
    value: Any = getattr(decoding, member)
    if member == "choice":
        value = tuple(value.choices)
        if not value:
            raise InvalidRequest("decoding.choice needs at least one choice")
    return StructuredOutputs(**{_CONSTRAINTS[member]: value})


def _candidates(candidates: npb.CandidateTokens, where: str) -> tuple[int | None, tuple[int, ...]]:
    """(how many most likely tokens, -1 every token; or the tokens asked for by id)."""
    kind = candidates.WhichOneof("kind")
    if kind == "top_n":
        return candidates.top_n, ()
    if kind == "all":
        return (-1, ()) if candidates.all else (0, ())
    if kind == "token_ids":
        ids = tuple(candidates.token_ids.ids)
        if not ids:
            raise InvalidRequest(f"{where}.token_ids names no tokens")
        return None, ids
    return 0, ()


def sampling_options(request: npb.GenerateRequest) -> SamplingOptions:
    """The request's sampling, decoding, stopping and response fields as SamplingOptions."""
    sampling, decoding, stopping, response = (
        request.sampling, request.decoding, request.stopping, request.response,
    )  # fmt: skip
    logprobs: int | None = None
    by_id: tuple[int, ...] = ()
    if response.HasField("output_candidates"):
        logprobs, by_id = _candidates(response.output_candidates, "response.output_candidates")
    elif response.output_logprobs:
        logprobs = 0
    prompt_logprobs: int | None = None
    if response.HasField("prompt_candidates"):
        prompt_logprobs, prompt_ids = _candidates(
            response.prompt_candidates, "response.prompt_candidates"
        )
        if prompt_ids:
            raise Unsupported(
                "response.prompt_candidates.token_ids is not served: vLLM's AsyncLLM scores "
                "prompt tokens by rank only (use top_n or all)"
            )
    elif response.prompt_logprobs:
        prompt_logprobs = 0
    return SamplingOptions(
        temperature=request.temperature if request.HasField("temperature") else None,
        n=sampling.num_sequences or 1,
        top_k=sampling.top_k or 0,
        top_p=sampling.top_p or 1.0,
        min_p=sampling.min_p,
        seed=sampling.seed if sampling.HasField("seed") else None,
        presence_penalty=decoding.presence_penalty,
        frequency_penalty=decoding.frequency_penalty,
        repetition_penalty=decoding.repetition_penalty or 1.0,
        logit_bias=dict(decoding.logit_bias) or None,
        allowed_token_ids=tuple(decoding.allowed_token_ids),
        structured_outputs=_structured_outputs(decoding),
        max_tokens=stopping.max_new_tokens or None,
        min_tokens=stopping.min_new_tokens,
        stop_token_ids=tuple(stopping.stop_token_ids),
        stop=tuple(stopping.stop_strings),
        include_stop_str_in_output=stopping.include_stop_strings,
        ignore_eos=stopping.ignore_eos,
        skip_special_tokens=(
            response.skip_special_tokens if response.HasField("skip_special_tokens") else None
        ),
        logprobs=logprobs,
        logprob_token_ids=by_id,
        prompt_logprobs=prompt_logprobs,
    )


def dp_rank(metadata: Sequence[tuple[str, str | bytes]] | None, facts: ModelFacts) -> int | None:
    """The data-parallel rank the router pinned the request to (call metadata)."""
    for key, value in metadata or ():
        if key == DP_RANK_KEY:
            text = value if isinstance(value, str) else value.decode(errors="replace")
            try:
                rank = int(text.strip())
            except ValueError:
                raise InvalidRequest(
                    f"{DP_RANK_KEY} metadata must be an integer, got {text!r}"
                ) from None
            return checked_dp_rank(rank, facts, DP_RANK_KEY)
    return None


def _media(items: Sequence[npb.MediaItem]) -> dict[str, Any]:
    media = []
    for i, item in enumerate(items):
        modality = _MODALITIES.get(item.modality or npb.MODALITY_IMAGE)
        if modality is None:
            raise InvalidRequest(f"media[{i}].modality {item.modality} is not a known modality")
        source = item.WhichOneof("source")
        if source == "features":
            raise Unsupported(
                f"media[{i}].features (preprocessed media) is not served: send the encoded "
                "bytes or a URL, this worker runs the model's processor itself"
            )
        if source is None:
            raise InvalidRequest(f"media[{i}] carries no source (url, data_uri or raw_bytes)")
        value = getattr(item, source)
        if not value:
            raise InvalidRequest(f"media[{i}].{source} is empty")
        media.append(
            MediaItem(
                modality,
                data=value if source == "raw_bytes" else None,
                url=value if source != "raw_bytes" else None,
                uuid=item.uuid or None,
            )
        )
    return {"media": tuple(media), "media_field": "media"} if media else {}


def _checked_model(model: str, facts: ModelFacts) -> None:
    if model and model not in (facts.served_model_name, facts.model_name):
        raise NotFound(
            f"model {model!r} is not served by this worker (it serves {facts.served_model_name!r})"
        )


def kv_transfer_params(kv: npb.KVCacheParameters) -> Mapping[str, Any] | None:
    if not kv.HasField("kv_transfer_params"):
        return None
    return json_format.MessageToDict(kv.kv_transfer_params)


def to_generation_request(
    request: npb.GenerateRequest,
    facts: ModelFacts,
    metadata: Sequence[tuple[str, str | bytes]] | None,
    trace: Mapping[str, str] | None,
) -> GenerationRequest:
    _checked_model(request.model, facts)
    _refuse_unserved(request)
    sampling = sampling_options(request)
    prompt = request.WhichOneof("prompt")
    ids: list[int] | None = None
    text: str | None = None
    if prompt == "text":
        text = request.text
        if not text:
            raise InvalidRequest("text is empty: the prompt needs at least one token")
    else:
        ids = list(request.token_ids.ids)
        if request.truncate_prompt_tokens:
            ids = ids[-request.truncate_prompt_tokens :]
    if text is not None and request.truncate_prompt_tokens:
        raise Unsupported(
            "truncate_prompt_tokens applies to token_ids prompts here; tokenize the text "
            "and send token_ids"
        )
    response = request.response
    return GenerationRequest(
        request_id=checked_request_id(request.request_id),
        prompt_token_ids=ids,
        prompt_text=text,
        sampling=sampling,
        dp_rank=dp_rank(metadata, facts),
        detokenize=response.output_text if response.HasField("output_text") else True,
        lora_name=request.lora_name or None,
        priority=request.priority,
        trace_headers=trace,
        kv_transfer_params=kv_transfer_params(request.kv),
        fill_context=True,
        prompt_field="token_ids",
        cache_salt=request.kv.cache_salt or None,
        skip_prefix_cache=request.kv.bypass_prefix_cache,
        **_media(request.media),
    )


def with_prompt_ids(request: GenerationRequest, ids: list[int]) -> GenerationRequest:
    return dataclasses.replace(request, prompt_token_ids=ids, prompt_text=None)
