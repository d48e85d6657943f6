"""vllm.Inference requests -> the neutral engine types (pure functions).

Semantics follow vllm-rs, the server this contract comes from: an unset temperature is
greedy (0.0; vllm-router always sends one), a zero elsewhere means "unset" and takes the
model's generation-config default (else vLLM's neutral value), `max_new_tokens` 0 (or
one past the context) generates until the context is full (the router sends 0 when its
client set no maximum), text is produced unless `response.output_text` is false,
logprobs only with `response.output_logprobs` (its candidates saying how many
alternatives), and the data-parallel rank comes from the `x-data-parallel-rank` call
metadata. One difference is kept: `num_sequences` > 1 is served (vllm-rs refuses it).
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
    if request.media and request.truncate_prompt_tokens:
        raise InvalidRequest("truncate_prompt_tokens is not supported for multimodal requests")
    if request.media and request.WhichOneof("prompt") == "text":
        raise InvalidRequest(
            "media needs a token_ids prompt (with one placeholder per item, as the model's "
            "chat template writes it)"
        )
    if request.kv.HasField("ec_transfer_params"):
        raise Unsupported("kv.ec_transfer_params is set: no encoder-cache connector runs here")


def _structured_outputs(decoding: npb.DecodingParameters) -> StructuredOutputs | None:
    member = decoding.WhichOneof("structured_output")
    if member is None:
        return None
    value: Any = getattr(decoding, member)
    if member == "json_object" and not value:
        return None  # asks for no constraint, as vllm-rs reads it
    if member == "choice":
        value = tuple(value.choices)
        if not value:
            raise InvalidRequest("decoding.choice needs at least one choice")
    return StructuredOutputs(**{_CONSTRAINTS[member]: value})


def _scores(
    wanted: bool, candidates: npb.CandidateTokens | None
) -> tuple[int | None, tuple[int, ...]]:
    """(logprobs: how many alternatives, -1 every token, None none; tokens asked for by id)."""
    if not wanted:
        return None, ()
    kind = candidates.WhichOneof("kind") if candidates is not None else None
    if kind == "top_n":
        return candidates.top_n, ()  # type: ignore[union-attr]
    if kind == "all" and candidates.all:  # type: ignore[union-attr]
        return -1, ()
    if kind == "token_ids" and candidates.token_ids.ids:  # type: ignore[union-attr]
        return None, tuple(candidates.token_ids.ids)  # type: ignore[union-attr]
    return 0, ()


def _zero_unset(value: float) -> float | None:
    return value or None


def sampling_options(request: npb.GenerateRequest) -> SamplingOptions:
    """The request's sampling, decoding, stopping and response fields as SamplingOptions."""
    sampling, decoding, stopping, response = (
        request.sampling, request.decoding, request.stopping, request.response,
    )  # fmt: skip
    output = response.output_candidates if response.HasField("output_candidates") else None
    logprobs, by_id = _scores(response.output_logprobs, output)
    prompt = response.prompt_candidates if response.HasField("prompt_candidates") else None
    prompt_logprobs, prompt_ids = _scores(response.prompt_logprobs, prompt)
    if prompt_ids:
        raise InvalidRequest(
            "response.prompt_candidates.token_ids is not supported: vLLM scores prompt "
            "tokens by rank only (use top_n or all)"
        )
    return SamplingOptions(
        temperature=request.temperature if request.HasField("temperature") else 0.0,
        n=sampling.num_sequences or 1,
        top_k=sampling.top_k or None,
        top_p=_zero_unset(sampling.top_p),
        min_p=_zero_unset(sampling.min_p),
        seed=sampling.seed if sampling.HasField("seed") else None,
        presence_penalty=_zero_unset(decoding.presence_penalty),
        frequency_penalty=_zero_unset(decoding.frequency_penalty),
        repetition_penalty=_zero_unset(decoding.repetition_penalty),
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
    """The request as the engine takes it; a text prompt stays text (the serving core
    tokenizes it) unless `with_prompt_ids` gives its ids first."""
    _checked_model(request.model, facts)
    _refuse_unserved(request)
    sampling = sampling_options(request)
    prompt = request.WhichOneof("prompt")
    if prompt is None:
        raise InvalidRequest("prompt is required: set token_ids or text")
    ids: list[int] | None = None
    text: str | None = None
    if prompt == "text":
        text = request.text
        if not text:
            raise InvalidRequest("text is empty: the prompt needs at least one token")
    else:
        ids = truncated(list(request.token_ids.ids), request, facts)
    response = request.response
    return GenerationRequest(
        request_id=checked_request_id(request.request_id),
        prompt_token_ids=ids,
        prompt_text=text,
        sampling=sampling,
        dp_rank=dp_rank(metadata, facts),
        detokenize=output_text(response),
        lora_name=request.lora_name or None,
        priority=request.priority,
        trace_headers=trace,
        kv_transfer_params=kv_transfer_params(request.kv),
        fill_context=True,
        prompt_field="token_ids",
        cache_salt=request.kv.cache_salt or None,
        skip_prefix_cache=request.kv.bypass_prefix_cache,
        session_id=request.session_id or None,
        **_media(request.media),
    )


def truncated(ids: list[int], request: npb.GenerateRequest, facts: ModelFacts) -> list[int]:
    """truncate_prompt_tokens N > 0 keeps the last N prompt tokens (0: all of them)."""
    keep = request.truncate_prompt_tokens
    if not keep:
        return ids
    if keep > facts.max_model_len:
        raise InvalidRequest(
            f"truncate_prompt_tokens={keep} cannot be greater than max_model_len "
            f"{facts.max_model_len}"
        )
    return ids[-keep:]


def output_text(response: npb.ResponseOptions) -> bool:
    """Whether text goes back with the tokens (`output_text`, default true)."""
    return response.output_text if response.HasField("output_text") else True


def with_prompt_ids(
    generation: GenerationRequest, ids: list[int], request: npb.GenerateRequest, facts: ModelFacts
) -> GenerationRequest:
    """A text prompt's ids (tokenized by the engine), truncated as token_ids would be."""
    ids = truncated(ids, request, facts)
    return dataclasses.replace(generation, prompt_token_ids=ids, prompt_text=None)
