"""Conversions between the neutral types and vLLM's: sampling params, logprobs, finish
reasons, errors.

vLLM is imported inside the functions, so this module imports without vLLM.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import operator
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, NoReturn

from ...errors import EngineDead, InvalidRequest, Overloaded, RequestFailed
from ..types import (
    FINISH_REASONS,
    NEUTRAL_DEFAULT,
    FinishReason,
    SamplingOptions,
    SpecDecodeCounts,
    StructuredOutputs,
    TokenLogprob,
)

if TYPE_CHECKING:
    from vllm.sampling_params import SamplingParams

# Fields that take the model's generation-config value when unset (see types.py).
_MODEL_DEFAULTED = {
    f.name: f.metadata[NEUTRAL_DEFAULT]
    for f in dataclasses.fields(SamplingOptions)
    if NEUTRAL_DEFAULT in f.metadata
}
# Fields built below rather than passed through by name.
_BUILT = {"max_tokens", "stop", "stop_token_ids", "structured_outputs"}
# Everything else passes through by name when set; unset ones take vLLM's own defaults.
_PASSED_THROUGH = tuple(
    f.name
    for f in dataclasses.fields(SamplingOptions)
    if f.name not in _MODEL_DEFAULTED and f.name not in _BUILT
)
# Every keyword build_sampling_params may give SamplingParams.from_optional: each option by
# its name, and the request-level ones (`vllm-servicer check-vllm` looks for them all).
SAMPLING_KEYWORDS = (
    *(f.name for f in dataclasses.fields(SamplingOptions)),
    "detokenize", "extra_args", "output_kind", "skip_clone",
)  # fmt: skip


def build_sampling_params(
    options: SamplingOptions,
    *,
    model_defaults: Mapping[str, Any],
    prompt_len: int,
    max_model_len: int,
    detokenize: bool,
    kv_transfer_params: Mapping[str, Any] | None = None,
    skip_prefix_cache: bool = False,
) -> SamplingParams:
    """SamplingParams as vLLM's OpenAI server would build them for this request.

    `model_defaults` is `ModelConfig.get_diff_sampling_param()`: a field the client
    left unset takes the model's generation-config value, else vLLM's neutral
    default. Raises vLLM's validation error for values it rejects.
    """
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    values: dict[str, Any] = {
        name: value if (value := getattr(options, name)) is not None
        else model_defaults.get(name, neutral)
        for name, neutral in _MODEL_DEFAULTED.items()
    }  # fmt: skip
    for name in _PASSED_THROUGH:
        value = getattr(options, name)
        if isinstance(value, tuple):
            if value:
                values[name] = list(value)
        elif value is not None:
            values[name] = value
    max_tokens = options.max_tokens
    if max_tokens is None:
        room = max_model_len - prompt_len
        default_max = model_defaults.get("max_tokens")
        max_tokens = room if default_max is None else min(room, default_max)
    stop_token_ids = list(options.stop_token_ids)
    for extra in model_defaults.get("stop_token_ids") or ():
        if extra not in stop_token_ids:
            stop_token_ids.append(extra)
    params = SamplingParams.from_optional(
        **values,
        max_tokens=max_tokens,
        stop=list(options.stop),
        stop_token_ids=stop_token_ids,
        detokenize=detokenize,
        structured_outputs=structured_outputs_params(options.structured_outputs),
        # vLLM's KV connectors read their parameters from here (as vLLM's own servers pass them).
        extra_args={"kv_transfer_params": dict(kv_transfer_params)} if kv_transfer_params else None,
        output_kind=RequestOutputKind.DELTA,
        skip_clone=True,
    )
    if skip_prefix_cache:
        params.skip_reading_prefix_cache = True
    return params


# The options that decide a SamplingParams apart from its seed (see SharedParams).
_ALL_BUT_SEED = operator.attrgetter(
    *(f.name for f in dataclasses.fields(SamplingOptions) if f.name != "seed")
)


class SharedParams:
    """SamplingParams built once for every request that asks for the same thing.

    vLLM takes a request's params as shared ("`params` may be shared across prompts,
    requests and even engines by the caller"): `InputProcessor.process_inputs` validates
    them and works on its own copy of them for the request (`clone`; a shallow copy, as
    these are built with `skip_clone`). What that copy writes into the lists and sets it
    shares is this engine's EOS ids, the same for every request. So requests whose options
    are equal (and hashable) share one SamplingParams: a router sends the same few sampling
    settings again and again. Requests that differ only in their seed (vllm-router seeds
    every request) get a shallow copy of it with their seed, vLLM's own clone: a seed is
    not validated and changes nothing else. Not shared: structured outputs (vLLM records
    the chosen backend on the params it validates) and KV-transfer parameters (one
    request's own).
    """

    # Distinct settings kept; past it the table starts again.
    LIMIT = 256

    __slots__ = ("_build", "_table")

    def __init__(self, build: Callable[..., SamplingParams]) -> None:
        # build_sampling_params with the model's keywords bound: (options, prompt_len=,
        # **request) -> SamplingParams.
        self._build = build
        self._table: dict[Any, SamplingParams] = {}

    def get(self, options: SamplingOptions, prompt_len: int, **request: Any) -> SamplingParams:
        """`request`: the build's request-level keywords (detokenize, kv_transfer_params,
        skip_prefix_cache)."""
        seed = options.seed
        if (
            options.structured_outputs is not None
            or request.get("kv_transfer_params")
            or (seed is not None and seed < 0)  # vLLM reads -1 as none: built as asked
        ):
            return self._build(options, prompt_len=prompt_len, **request)
        # The default max_tokens depends on the prompt's length; a set one does not.
        key = (
            _ALL_BUT_SEED(options),
            request.get("detokenize"),
            request.get("skip_prefix_cache"),
            prompt_len if options.max_tokens is None else -1,
        )
        try:
            params = self._table.get(key)
        except TypeError:  # unhashable options (a logit bias map): built for the request
            return self._build(options, prompt_len=prompt_len, **request)
        if params is None:
            params = self._build(options, prompt_len=prompt_len, **request)
            if len(self._table) >= self.LIMIT:
                self._table.clear()
            self._table[key] = params
        elif params.seed != seed:
            params = copy.copy(params)
            params.seed = seed
        return params


def structured_outputs_params(constraint: StructuredOutputs | None) -> Any:
    """vLLM's StructuredOutputsParams for a constraint (same field names)."""
    if constraint is None:
        return None
    from vllm.sampling_params import StructuredOutputsParams

    values = dataclasses.asdict(constraint)
    if constraint.choice is not None:
        values["choice"] = list(constraint.choice)
    return StructuredOutputsParams(**values)


def convert_logprobs(
    token_ids: list[int], positions: Any, num_top: int, by_id: tuple[int, ...] = ()
) -> list[TokenLogprob]:
    """vLLM's per-position {token id: Logprob} maps -> TokenLogprob with the `num_top` best
    (-1: every token in the map), or with the tokens `by_id` names, in that order."""
    entries = []
    for token_id, position in zip(token_ids, positions or (), strict=False):
        position = position or {}
        sampled = position.get(token_id)
        if by_id:
            top = [(p.rank, tid, p.logprob) for tid in by_id if (p := position.get(tid))]
        else:
            top = sorted(
                (lp.rank, tid, lp.logprob)
                for tid, lp in position.items()
                if lp.rank is not None and (num_top < 0 or lp.rank <= num_top)
            )
        entries.append(
            TokenLogprob(
                token_id=token_id,
                logprob=sampled.logprob if sampled is not None else -math.inf,
                top=tuple((tid, logprob) for _, tid, logprob in top),
                rank=sampled.rank if sampled is not None else None,
                top_ranks=tuple(rank or 0 for rank, _, _ in top),
            )
        )
    return entries


def convert_prompt_logprobs(
    prompt_ids: list[int], positions: Any, num_top: int
) -> list[TokenLogprob]:
    """vLLM's prompt logprobs (None for the first position) -> one entry per prompt token."""
    entries = convert_logprobs(prompt_ids[1:], list(positions or ())[1:], num_top)
    return [TokenLogprob(prompt_ids[0], math.nan), *entries] if prompt_ids else []


def spec_decode_of(metrics: Any) -> SpecDecodeCounts | None:
    """A sample's speculative-decoding counts from vLLM's RequestSpecDecodeMetrics (None
    without): the draft tokens proposed, and the accepted ones (histogram[j] counts the
    verify steps that accepted j drafts), as vLLM's own --grpc server reports them."""
    if metrics is None:
        return None
    accepted = sum(j * steps for j, steps in enumerate(metrics.histogram))
    return SpecDecodeCounts(draft_tokens=int(metrics.num_draft_tokens), accepted_tokens=accepted)


def finish_of(
    finish_reason: Any, stop_reason: int | str | None, last_token: int | None, error: Any = None
) -> tuple[FinishReason | None, int | str | None, str | None]:
    """vLLM's finish (enum or string) as (reason, matched stop, error message).

    A request that ended on EOS reports that EOS id as its match; only a `stop` finish
    has a match (vLLM gives `repetition` the stop reason "repetition_detected"). A
    reason this worker does not know is an `error`, so it can never pass for an answer.
    """
    if finish_reason is None:
        return None, None, None
    name = str(finish_reason)
    if name == "stop":
        return "stop", last_token if stop_reason is None else stop_reason, None
    if name not in FINISH_REASONS:
        return "error", None, f"vLLM finished the request with an unknown reason {name!r}"
    if name == "error":
        detail = getattr(error, "message", None) or "vLLM gave no detail"
        return "error", None, detail
    return name, None, None  # type: ignore[return-value]


def translate_error(exc: Exception) -> Exception:
    """vLLM's exceptions -> the servicer's (see errors.py); anything else is returned as is.

    vLLM validates requests by raising ValueError/TypeError (or its VLLMClientError
    subclasses) before the request reaches the engine core: those are the client's.
    """
    from vllm.exceptions import GenerationError, GracefulHTTPError, VLLMClientError
    from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError

    if isinstance(exc, EngineDeadError):
        return EngineDead("vLLM engine is dead (EngineDeadError); retry on another worker")
    if isinstance(exc, GracefulHTTPError):
        return Overloaded(exc.message)
    if isinstance(exc, GenerationError):
        # vLLM 0.33 hands a request the engine refused or failed (e.g. paused, retryable)
        # to the front end as this exception instead of an `error` finish.
        return RequestFailed(f"the engine failed this request: {exc}; retry on another worker")
    if isinstance(exc, (VLLMClientError, ValueError, TypeError)):
        return InvalidRequest(str(exc))
    if isinstance(exc, EngineGenerateError) and isinstance(
        exc.__cause__, (VLLMClientError, ValueError, TypeError)
    ):
        return InvalidRequest(str(exc.__cause__))
    return exc


def reraise(exc: Exception) -> NoReturn:
    translated = translate_error(exc)
    if translated is exc:
        raise exc
    raise translated from exc
