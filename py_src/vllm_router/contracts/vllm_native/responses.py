"""The neutral engine types -> vllm.Inference / vllm.Control messages (pure functions)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from google.protobuf import json_format, struct_pb2

from ...core.accumulate import RequestResult
from ...core.flight import DirectStepRenderer
from ...engine import EngineStep, KvEventSource, LoraAdapter, ModelFacts, TokenLogprob
from ...errors import RequestFailed
from ...proto import vllm_native_pb2 as npb
from .convert import output_text

# The schema version of vLLM's contract this worker implements, as vllm-rs reports it
# (0.33: "0.6.0"; 0.34, whose Sleep takes level 0 and reset_connector: "0.7.0").
PROTO_VERSION = "0.7.0"
API_VERSION = "vllm"

_FINISH = {
    "stop": npb.STOP,
    "length": npb.LENGTH,
    "abort": npb.ABORTED,
    # As vllm-rs: vLLM's repetition detection cut the request short.
    "repetition": npb.ABORTED,
}


@dataclass(frozen=True, slots=True)
class Wanted:
    """What the request's `response` options ask to be sent back."""

    text: bool
    token_ids: bool
    logprobs: bool  # with each position's candidates (none asked for: empty)
    prompt_token_ids: bool
    prompt_logprobs: bool

    @classmethod
    def of(cls, response: npb.ResponseOptions) -> Wanted:
        return cls(
            text=output_text(response),
            token_ids=response.output_token_ids,
            logprobs=response.output_logprobs,
            prompt_token_ids=response.prompt_token_ids,
            prompt_logprobs=response.prompt_logprobs,
        )


def _struct(values: Mapping[str, Any]) -> struct_pb2.Struct:
    message = struct_pb2.Struct()
    json_format.ParseDict(dict(values), message)
    return message


def _candidates(entry: TokenLogprob) -> npb.CandidateTokenInfo:
    ranks = entry.top_ranks or tuple(range(1, len(entry.top) + 1))
    return npb.CandidateTokenInfo(
        tokens=[
            npb.TokenInfo(id=token_id, logprob=logprob, rank=rank)
            for (token_id, logprob), rank in zip(entry.top, ranks, strict=True)
        ]
    )


def prompt_info(
    step: EngineStep, prompt_ids: list[int] | None, wanted: Wanted
) -> npb.GenerateResponse:
    """The stream's first message: the prompt's size, and its ids and scores when asked."""
    info = npb.PromptInfo(num_prompt_tokens=step.prompt_tokens)
    if wanted.prompt_token_ids and prompt_ids is not None:
        info.token_ids.extend(prompt_ids)
    # One entry per prompt position; the first has no score (nothing precedes it): as
    # vllm-rs, logprob 0, rank 0 and no candidates there.
    entries = step.prompt_logprobs or ()
    if wanted.prompt_logprobs:
        info.logprobs.extend(0.0 if math.isnan(e.logprob) else e.logprob for e in entries)
        info.ranks.extend(e.rank or 0 for e in entries)
        info.candidate_tokens.extend(
            npb.CandidateTokenInfo() if math.isnan(e.logprob) else _candidates(e) for e in entries
        )
    return npb.GenerateResponse(prompt_info=info)


def finish_info(step: EngineStep, eos_ids: frozenset[int]) -> npb.FinishInfo:
    if step.finish_reason == "error":
        # vllm-rs fails the stream; a router retries elsewhere.
        raise RequestFailed(f"the engine failed this request: {step.error or 'no detail'}")
    info = npb.FinishInfo(
        num_output_tokens=step.completion_tokens,
        finish_reason=_FINISH.get(step.finish_reason or "stop", npb.STOP),
        num_cached_tokens=step.cached_tokens,
    )
    reason = step.stop_reason
    if step.finish_reason == "stop":
        if isinstance(reason, str):
            info.stop_string = reason
        elif reason is not None and reason in eos_ids:
            info.eos_token_id = reason
        elif reason is not None:
            info.stop_token_id = reason
    if step.kv_transfer_params:
        info.kv_transfer_params.CopyFrom(_struct(step.kv_transfer_params))
    return info


def sequence_output(
    step: EngineStep, wanted: Wanted, eos_ids: frozenset[int]
) -> npb.GenerateResponse:
    """One sequence's news from one engine step (its finish on its last)."""
    output = npb.SequenceOutput(index=step.index, num_tokens=len(step.token_ids))
    if wanted.text:
        output.text = step.text
    if wanted.token_ids:
        output.token_ids.extend(step.token_ids)
    fill_scores(output, step.logprobs, wanted)
    if step.finished:
        output.finish_info.CopyFrom(finish_info(step, eos_ids))
    return npb.GenerateResponse(outputs=output)


def direct_step_renderer(wanted: Wanted) -> DirectStepRenderer:
    """One stream's `sequence_output` of a plain step, for its `wanted` (core/flight.py's
    DirectStepRenderer): one message, rendered again for every step. A plain step has no
    text, no scores and no finish."""
    with_ids = wanted.token_ids
    response = npb.GenerateResponse()
    output = response.outputs
    output.SetInParent()
    token_ids = output.token_ids

    def render(ids: list[int], last: EngineStep, completion_tokens: int) -> npb.GenerateResponse:
        output.index = last.index
        output.num_tokens = len(ids)
        if with_ids:
            token_ids[:] = ids
        return response

    return render


def whole_answer(
    result: RequestResult,
    prompt_ids: list[int] | None,
    wanted: Wanted,
    eos_ids: frozenset[int],
) -> npb.GenerateResponse:
    """Generate's one message: what a stream spreads over several (the prompt's facts, every
    token, the finish), as vllm-rs answers it. `result` holds one sequence (Generate
    refuses more: see convert)."""
    (_, sample), = result.in_order()  # fmt: skip
    last = sample.last
    assert last is not None
    whole = EngineStep(
        token_ids=sample.token_ids,
        text=sample.output_text,
        finished=True,
        finish_reason=last.finish_reason,
        stop_reason=last.stop_reason,
        prompt_tokens=last.prompt_tokens,
        completion_tokens=last.completion_tokens,
        cached_tokens=last.cached_tokens,
        logprobs=sample.logprobs,
        kv_transfer_params=last.kv_transfer_params,
        error=last.error,
        prompt_logprobs=result.prompt_logprobs,
    )
    answer = sequence_output(whole, wanted, eos_ids)
    answer.prompt_info.CopyFrom(prompt_info(whole, prompt_ids, wanted).prompt_info)
    return answer


def fill_scores(
    output: npb.SequenceOutput, entries: list[TokenLogprob] | None, wanted: Wanted
) -> None:
    # As vllm-rs: with logprobs, every position has its (maybe empty) candidates.
    if wanted.logprobs and entries:
        output.logprobs.extend(e.logprob for e in entries)
        output.ranks.extend(e.rank or 0 for e in entries)
        output.candidate_tokens.extend(_candidates(e) for e in entries)


def server_info(facts: ModelFacts, instance_id: str) -> npb.GetServerInfoResponse:
    return npb.GetServerInfoResponse(
        engine_version=facts.engine_version,
        api_version=API_VERSION,
        instance_id=instance_id,
        parallelism=npb.Parallelism(
            tensor_parallel_size=facts.tensor_parallel_size,
            pipeline_parallel_size=facts.pipeline_parallel_size,
            data_parallel_size=facts.dp_size,
            data_parallel_rank=0,  # the first rank this worker serves
            decode_context_parallel_size=1,
            world_size=facts.tensor_parallel_size * facts.pipeline_parallel_size,
            data_parallel_size_local=facts.dp_size,
        ),
        max_model_len=facts.max_model_len,
        kv_block_size=facts.block_size,
        total_kv_blocks=facts.total_kv_blocks,
        max_running_requests=facts.max_num_seqs,
        max_batched_tokens=facts.max_batched_tokens,
        max_loras=facts.max_loras,
        rl_capabilities=npb.RlCapabilities(
            sleep_mode_enabled=facts.sleep_mode,
            weight_transfer_enabled=bool(facts.weight_transfer_backend),
            weight_transfer_backend=facts.weight_transfer_backend,
            draft_weight_updates_enabled=facts.draft_weight_updates,
        ),
        proto_version=PROTO_VERSION,
        effective_attention_block_size=facts.block_size,
    )


def model_info(facts: ModelFacts) -> npb.GetModelInfoResponse:
    aliases = [facts.model_name] if facts.model_name != facts.served_model_name else []
    return npb.GetModelInfoResponse(
        model_id=facts.model_name,
        served_model_name=facts.served_model_name,
        served_model_aliases=aliases,
        supports_text_input=True,
        supports_token_ids_input=True,
        supports_lora=facts.supports_lora,
        supports_multimodal=bool(facts.media_limits),
    )


def kv_event_sources(sources: Iterable[KvEventSource]) -> npb.GetKvEventSourcesResponse:
    return npb.GetKvEventSourcesResponse(
        sources=[
            npb.KvEventSource(
                transport="zmq",
                endpoint=s.endpoint,
                topic=s.topic,
                replay_endpoint=s.replay_endpoint,
                data_parallel_rank=s.dp_rank,
                encoding="msgpack",
                schema_version=1,
                buffer_steps=s.buffer_steps,
                hwm=s.hwm,
                max_queue_size=s.max_queue_size,
            )
            for s in sources
        ]
    )


def lora_adapter(adapter: LoraAdapter) -> npb.LoraAdapter:
    return npb.LoraAdapter(
        lora_id=adapter.lora_id, lora_name=adapter.name, source_path=adapter.path
    )
