"""vllm.Inference / vllm.Control requests -> the neutral engine types (pure functions).

Semantics follow vllm-rs, the server this contract comes from: an unset temperature is
greedy (0.0; vllm-router always sends one), a zero elsewhere means "unset" and takes the
model's generation-config default (else vLLM's neutral value), `max_new_tokens` 0 (or
one past the context) generates until the context is full (the router sends 0 when its
client set no maximum), text is produced unless `response.output_text` is false,
logprobs only with `response.output_logprobs` (its candidates saying how many
alternatives), and the data-parallel rank comes from the `x-data-parallel-rank` call
metadata. Checks run in vllm-rs's order where a request is wrong twice: the rank's form,
the model, the prompt's presence (`check_first`), then the request's own fields, its LoRA
(`lora_name` on a worker without LoRA is FAILED_PRECONDITION), its media, then (at
admission) its prompt and sampling values. One difference is kept: `num_sequences` > 1 is
served on GenerateStream (vllm-rs refuses it), except that a request refused for anything
else is told vllm-rs's refusal of the sequences (`sequences_first`). A thinking budget and
a reasoning gate are passed to the engine as vllm-rs passes them. Sampling is read
through the core's table (`SAMPLING`), as on every contract.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Collection, Iterator, Mapping, Sequence
from typing import Any

from google.protobuf import json_format

from ...core.request_fields import checked_dp_rank, checked_request_id
from ...core.sampling import SamplingTable
from ...engine import GenerationRequest, MediaItem, ModelFacts, StructuredOutputs
from ...errors import (
    EngineUnavailable,
    InvalidRequest,
    NotConfigured,
    NotFound,
    Overloaded,
    ServicerError,
    Unsupported,
)
from ...proto import vllm_native_pb2 as npb

DP_RANK_KEY = "x-data-parallel-rank"
NO_LORA = "LoRA is not enabled on this worker (start the engine with --enable-lora)"

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
}


def _refuse_unserved(request: npb.GenerateRequest) -> None:
    for name, why in _REFUSED.items():
        # watermarking false asks for nothing.
        if request.HasField(name) and (name != "watermarking" or request.watermarking):
            raise Unsupported(f"{name} is set: {why}")
    if request.decoding.bad_words_token_ids:
        raise Unsupported(
            "decoding.bad_words_token_ids is not served: vLLM's AsyncLLM takes bad words as "
            "text only"
        )
    if request.kv.HasField("ec_transfer_params"):
        raise Unsupported("kv.ec_transfer_params is set: no encoder-cache connector runs here")


# -- sampling ---------------------------------------------------------------------------------


def _structured_outputs(request: npb.GenerateRequest) -> StructuredOutputs | None:
    decoding = request.decoding
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


def _thinking_budget(request: npb.GenerateRequest) -> int | None:
    """stopping.thinking_token_budget: unset or -1 is no limit, as vllm-rs reads it (a value
    below -1 is refused later, in vllm-rs's order: `_checked_budget`)."""
    stopping = request.stopping
    if not stopping.HasField("thinking_token_budget"):
        return None
    budget = stopping.thinking_token_budget
    return None if budget == -1 else budget


def _checked_budget(budget: int | None) -> None:
    if budget is not None and budget < 0:
        raise InvalidRequest(
            "`thinking_token_budget` must be a non-negative integer or -1 for unlimited."
        )


def _output_scores(request: npb.GenerateRequest) -> tuple[int | None, tuple[int, ...]]:
    response = request.response
    output = response.output_candidates if response.HasField("output_candidates") else None
    return _scores(response.output_logprobs, output)


def _prompt_logprobs(request: npb.GenerateRequest) -> int | None:
    response = request.response
    prompt = response.prompt_candidates if response.HasField("prompt_candidates") else None
    logprobs, by_id = _scores(response.prompt_logprobs, prompt)
    if by_id:
        raise InvalidRequest(
            "response.prompt_candidates.token_ids is not supported: vLLM scores prompt "
            "tokens by rank only (use top_n or all)"
        )
    return logprobs


# A zero in these is unset (None): the model's generation-config default, else vLLM's.
_ZERO_IS_UNSET = ("top_k", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                  "repetition_penalty", "max_tokens")  # fmt: skip
SAMPLING = SamplingTable(
    npb.GenerateRequest.DESCRIPTOR,
    parts=("sampling", "decoding", "stopping", "response"),
    names={
        "n": "num_sequences",
        "max_tokens": "max_new_tokens",
        "min_tokens": "min_new_tokens",
        "stop": "stop_strings",
        "include_stop_str_in_output": "include_stop_strings",
    },
    # Run in this order: a request wrong in both is told about its prompt candidates first.
    special={
        "prompt_logprobs": _prompt_logprobs,
        "logprobs": lambda request: _output_scores(request)[0],
        "logprob_token_ids": lambda request: _output_scores(request)[1],
        "structured_outputs": _structured_outputs,
        "thinking_token_budget": _thinking_budget,
    },
    # As vllm-rs: an unset temperature is greedy, num_sequences 0 is one sequence.
    fallbacks={"temperature": 0.0, "n": 1, **dict.fromkeys(_ZERO_IS_UNSET)},
)
# Fields of the sampling parts read outside the table: by its special converters (the
# logprobs and the structured-output constraint), refused, or by the servicer.
HANDLED_ELSEWHERE = frozenset(
    {
        *(f"decoding.{member}" for member in _CONSTRAINTS),
        "decoding.bad_words_token_ids",  # refused
        "response.prompt_candidates",
        "response.output_logprobs",
        "response.output_candidates",
        "response.output_text",  # GenerationRequest.detokenize
        "response.output_token_ids",  # the servicer's (Wanted)
        "response.prompt_token_ids",  # the servicer's (Wanted)
    }
)


# -- the request --------------------------------------------------------------------------------


def dp_rank_value(metadata: Sequence[tuple[str, str | bytes]] | None) -> int | None:
    """The `x-data-parallel-rank` call metadata as a number (None: not sent)."""
    for key, value in metadata or ():
        if key == DP_RANK_KEY:
            text = value if isinstance(value, str) else value.decode(errors="replace")
            try:
                return int(text.strip())
            except ValueError:
                raise InvalidRequest(
                    f"{DP_RANK_KEY} metadata must be an integer, got {text!r}"
                ) from None
    return None


def dp_rank(metadata: Sequence[tuple[str, str | bytes]] | None, facts: ModelFacts) -> int | None:
    """The data-parallel rank the router pinned the request to (call metadata)."""
    rank = dp_rank_value(metadata)
    return None if rank is None else checked_dp_rank(rank, facts, DP_RANK_KEY)


def _media(request: npb.GenerateRequest, facts: ModelFacts) -> dict[str, Any]:
    items = request.media
    if not items:
        return {}
    if request.truncate_prompt_tokens:
        raise InvalidRequest("truncate_prompt_tokens is not supported for multimodal requests")
    if request.WhichOneof("prompt") == "text":
        raise InvalidRequest(
            "media needs a token_ids prompt (with one placeholder per item, as the model's "
            "chat template writes it)"
        )
    media = []
    for i, item in enumerate(items):
        modality = _MODALITIES.get(item.modality or npb.MODALITY_IMAGE)
        if modality is None:
            raise InvalidRequest(f"media[{i}].modality {item.modality} is not a known modality")
        source = item.WhichOneof("source")
        if source == "features":
            if not facts.media_limits:
                # As vllm-rs: media for a text-only model is the client's mistake.
                raise InvalidRequest(
                    f"media[{i}].features: multimodal input is not supported: this worker's "
                    "model is text-only"
                )
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
    return {"media": tuple(media), "media_field": "media"}


def _checked_model(model: str, facts: ModelFacts) -> None:
    if model and model not in (facts.served_model_name, facts.model_name):
        raise NotFound(
            f"model {model!r} is not served by this worker (it serves {facts.served_model_name!r})"
        )


def _checked_lora(lora_name: str, facts: ModelFacts, loaded: Collection[str]) -> str | None:
    """The adapter a request names (None: the base model), on a worker with LoRA, loaded."""
    if not lora_name:
        return None
    if not facts.supports_lora:
        raise NotConfigured(NO_LORA)
    if lora_name not in loaded:
        raise NotFound(f"LoRA adapter `{lora_name}` is not loaded")
    return lora_name


# What vllm-rs (and vLLM's Python front end) take as a cache salt.
_SALT_MAX = 128
_SALT_FORBIDDEN = frozenset("@/\\\0")


def _checked_salt(salt: str) -> str | None:
    if not salt:
        return None
    if len(salt) > _SALT_MAX or not _SALT_FORBIDDEN.isdisjoint(salt):
        raise InvalidRequest(
            "Parameter 'cache_salt' must be a non-empty string of at most 128 characters "
            "and must not contain '@', '/', '\\', or NUL."
        )
    return salt


def kv_transfer_params(kv: npb.KVCacheParameters) -> Mapping[str, Any] | None:
    if not kv.HasField("kv_transfer_params"):
        return None
    return json_format.MessageToDict(kv.kv_transfer_params)


def to_generation_request(
    request: npb.GenerateRequest,
    facts: ModelFacts,
    metadata: Sequence[tuple[str, str | bytes]] | None,
    trace: Mapping[str, str] | None,
    *,
    unary: bool = False,
    loaded: Collection[str] = (),
) -> GenerationRequest:
    """The request as the engine takes it. A text prompt stays text: admission tokenizes
    it (`needs_prompt_ids` says when the servicer needs its ids first, `with_prompt_ids`
    truncates them). `unary`: for Generate, which answers one sequence. `loaded`: the
    LoRA adapters the engine has (read by the servicer when the request names one)."""
    check_first(request, metadata, facts)
    _refuse_unserved(request)
    sampling = SAMPLING.read(request)
    lora_name = _checked_lora(request.lora_name, facts, loaded)
    media = _media(request, facts)
    cache_salt = _checked_salt(request.kv.cache_salt)
    _checked_budget(sampling.thinking_token_budget)
    if sampling.thinking_token_budget is not None and not facts.thinking_budget:
        # As vllm-rs: taken, and without effect on an engine with no reasoning
        # configuration (its engine core applies a budget only with one; vLLM's Python
        # front end would refuse it).
        sampling = dataclasses.replace(sampling, thinking_token_budget=None)
    prompt = request.WhichOneof("prompt")
    ids: list[int] | None = None
    text: str | None = None
    if prompt == "text":
        text = request.text
        if not text:
            raise InvalidRequest("text is empty: the prompt needs at least one token")
        _check_truncation(request, facts)
    else:
        ids = truncated(list(request.token_ids.ids), request, facts)
    request_id = checked_request_id(request.request_id)
    rank = dp_rank(metadata, facts)
    if unary and (sampling.n or 1) > 1:
        raise InvalidRequest(
            "Generate answers one sequence (its response has one `outputs`): use "
            "GenerateStream for sampling.num_sequences > 1"
        )
    return GenerationRequest(
        request_id=request_id,
        prompt_token_ids=ids,
        prompt_text=text,
        sampling=sampling,
        dp_rank=rank,
        detokenize=output_text(request.response),
        lora_name=lora_name,
        priority=request.priority,
        trace_headers=trace,
        kv_transfer_params=kv_transfer_params(request.kv),
        fill_context=True,
        prompt_field="token_ids",
        cache_salt=cache_salt,
        skip_prefix_cache=request.kv.bypass_prefix_cache,
        session_id=request.session_id or None,
        **_reasoning_gate(request),
        **media,
    )


def _reasoning_gate(request: npb.GenerateRequest) -> dict[str, Any]:
    """engine_reasoning_gate, passed to the engine as vllm-rs passes it (it matters only
    to a structured-output constraint on an engine with a reasoning parser)."""
    if not request.HasField("engine_reasoning_gate"):
        return {}
    gate = request.engine_reasoning_gate
    return {
        "reasoning_ended": gate.reasoning_ended if gate.HasField("reasoning_ended") else None,
        "reasoning_kwargs": {
            "chat_template_kwargs": json_format.MessageToDict(gate.chat_template_kwargs)
        },
    }


def check_first(
    request: npb.GenerateRequest,
    metadata: Sequence[tuple[str, str | bytes]] | None,
    facts: ModelFacts,
) -> None:
    """What vllm-rs checks before it looks at `num_sequences`: the data-parallel rank's
    form, the model, that there is a prompt."""
    dp_rank_value(metadata)
    _checked_model(request.model, facts)
    if request.WhichOneof("prompt") is None:
        raise InvalidRequest("prompt is required: set token_ids or text")


MANY_SEQUENCES = "num_sequences > 1 is not supported"
# Failures that are not the request's fault: told as they are whatever it asked.
_NOT_REFUSALS = (EngineUnavailable, Overloaded)


@contextlib.contextmanager
def sequences_first(
    request: npb.GenerateRequest,
    metadata: Sequence[tuple[str, str | bytes]] | None,
    facts: ModelFacts,
) -> Iterator[None]:
    """num_sequences > 1, which vllm-rs refuses and this worker serves: a request refused for
    anything vllm-rs checks after it (its LoRA, media, prompt and sampling values, ...) is
    told vllm-rs's refusal of the sequences, so a router sees the reference's answer to
    every request the reference refuses. Wraps a request's handling (its refusals all come
    before its first message). What vllm-rs checks before the sequences (`check_first`,
    which conversion runs first) is asked again only on this refusal path."""
    try:
        yield
    except ServicerError as exc:
        if request.sampling.num_sequences > 1 and not isinstance(exc, _NOT_REFUSALS):
            check_first(request, metadata, facts)
            raise InvalidRequest(MANY_SEQUENCES) from exc
        raise


def _check_truncation(request: npb.GenerateRequest, facts: ModelFacts) -> None:
    keep = request.truncate_prompt_tokens
    if keep > facts.max_model_len:
        raise InvalidRequest(
            f"truncate_prompt_tokens={keep} cannot be greater than max_model_len "
            f"{facts.max_model_len}"
        )


def truncated(ids: list[int], request: npb.GenerateRequest, facts: ModelFacts) -> list[int]:
    """truncate_prompt_tokens N > 0 keeps the last N prompt tokens (0: all of them)."""
    keep = request.truncate_prompt_tokens
    if not keep:
        return ids
    _check_truncation(request, facts)
    return ids[-keep:]


def output_text(response: npb.ResponseOptions) -> bool:
    """Whether text goes back with the tokens (`output_text`, default true)."""
    return response.output_text if response.HasField("output_text") else True


def needs_prompt_ids(generation: GenerationRequest, request: npb.GenerateRequest) -> bool:
    """Whether the servicer needs a text prompt's ids before the request runs: to echo
    them (`response.prompt_token_ids`) or to truncate them (`truncate_prompt_tokens`)."""
    return generation.prompt_text is not None and bool(
        request.response.prompt_token_ids or request.truncate_prompt_tokens
    )


def with_prompt_ids(
    tokenized: GenerationRequest, request: npb.GenerateRequest, facts: ModelFacts
) -> GenerationRequest:
    """A tokenized text prompt (`Admission.tokenized`), truncated as token_ids would be."""
    if not request.truncate_prompt_tokens:
        return tokenized
    ids = truncated(tokenized.prompt_token_ids or [], request, facts)
    return dataclasses.replace(tokenized, prompt_token_ids=ids)
