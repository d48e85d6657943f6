"""The neutral engine types -> vllm.engine.v1 response messages (pure functions)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import grpc

from ...core.accumulate import RequestResult, SampleResult
from ...core.batching import Message
from ...core.flight import DirectStepRenderer
from ...core.media_admission import url_schemes
from ...engine import (
    Embedding,
    EngineStep,
    LoadSnapshot,
    LoraAdapter,
    ModelFacts,
    RankLoad,
    TokenLogprob,
)
from ...errors import RequestFailed
from ...proto import vllm_engine_pb2 as pb
from .rules import TOKENIZER_CHUNK_BYTES


def worker_metrics(load: LoadSnapshot) -> pb.WorkerMetrics:
    return pb.WorkerMetrics(
        running_requests=load.running_requests,
        waiting_requests=load.waiting_requests,
        kv_cache_usage_percent=load.kv_cache_usage * 100.0,
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
    message: pb.GenerateStreamResponse | pb.GenerateResponse | pb.Sample, step: EngineStep
) -> None:
    if isinstance(step.stop_reason, str):
        message.stop_str = step.stop_reason
    elif step.stop_reason is not None:
        message.stop_token_id = step.stop_reason


def raise_if_failed(step: EngineStep) -> None:
    """An `error` finish is no answer on this contract: the RPC fails UNAVAILABLE with the
    engine's message, so the router retries the request elsewhere."""
    if step.finish_reason == "error":
        raise RequestFailed(
            f"the engine failed this request: {step.error or 'no detail given'}; "
            "retry on another worker"
        )


def request_error(
    request_id: str, code: grpc.StatusCode, message: str, refused: bool
) -> pb.RequestError:
    return pb.RequestError(
        request_id=request_id, code=code.value[0], message=message, refused=refused
    )


def stream_message(
    request_id: str, step: EngineStep, metrics: pb.WorkerMetrics | None
) -> pb.GenerateStreamResponse:
    # Once per message: scalar fields set in place cost a third less than a Usage
    # message built and copied in.
    message = pb.GenerateStreamResponse(
        request_id=request_id,
        token_ids=step.token_ids,
        text_delta=step.text,
        metrics=metrics,
        index=step.index,
    )
    usage = message.usage
    usage.prompt_tokens = step.prompt_tokens
    usage.completion_tokens = step.completion_tokens
    usage.cached_tokens = step.cached_tokens
    if step.logprobs is not None:
        message.logprobs.extend(_logprobs(step.logprobs))
    if step.prompt_logprobs is not None:
        message.prompt_logprobs.extend(_logprobs(step.prompt_logprobs))
    if step.finished:
        message.is_finished = True
        message.finish_reason = step.finish_reason or ""
        _set_matched_stop(message, step)
        _add_spec_decode(usage, step)
    return message


def _add_spec_decode(usage: pb.Usage, last: EngineStep) -> None:
    """A finished sample's speculative-decoding counts, added to `usage`'s."""
    spec = last.spec_decode
    if spec is not None:
        usage.spec_draft_tokens += spec.draft_tokens
        usage.spec_accepted_tokens += spec.accepted_tokens


def direct_step_renderer(request_id: str) -> DirectStepRenderer:
    """One stream's `stream_message` of a plain step (core/flight.py's DirectStepRenderer):
    one message, rendered again for every step."""
    message = pb.GenerateStreamResponse(request_id=request_id)
    token_ids, usage = message.token_ids, message.usage

    def render(
        ids: list[int], last: EngineStep, completion_tokens: int
    ) -> pb.GenerateStreamResponse:
        token_ids[:] = ids
        message.index = last.index
        usage.prompt_tokens = last.prompt_tokens
        usage.completion_tokens = completion_tokens
        usage.cached_tokens = last.cached_tokens
        return message

    return render


def batch_message(
    message: Message[pb.GenerateStreamResponse, pb.RequestError],
) -> pb.GenerateBatchResponse:
    """A GenerateBatch message: the updates and errors, and what the requests' lanes took
    since the last one: compact lanes as TokenRuns columns, the others as the
    GenerateStream messages they would have had (tokens and usage)."""
    response = pb.GenerateBatchResponse(updates=message.updates, errors=message.errors)
    if not message.lanes:
        return response
    runs = response.tokens
    flat: list[int] = []
    for lane, token_ids in zip(message.lanes, message.lane_tokens, strict=True):
        if lane.compact:
            runs.request_ids.append(lane.request_id)
            runs.token_counts.append(len(token_ids))
            flat += token_ids
        else:
            update = response.updates.add(request_id=lane.request_id, token_ids=token_ids)
            usage = update.usage
            usage.prompt_tokens = lane.prompt_tokens
            usage.completion_tokens = lane.completion_tokens
            usage.cached_tokens = lane.cached_tokens
    if flat:
        runs.token_ids.extend(flat)
    return response


def _fill_sample(message: pb.GenerateResponse | pb.Sample, sample: SampleResult) -> None:
    message.output_token_ids.extend(sample.token_ids)
    message.output_text = sample.output_text
    if sample.last is not None:
        message.finish_reason = sample.last.finish_reason or ""
        _set_matched_stop(message, sample.last)
    if sample.logprobs is not None:
        message.logprobs.extend(_logprobs(sample.logprobs))


def unary_response(
    request_id: str, result: RequestResult, metrics: pb.WorkerMetrics | None
) -> pb.GenerateResponse:
    """A finished request: sample 0 at the top level, every sample in `samples` when n > 1."""
    message = pb.GenerateResponse(request_id=request_id, metrics=metrics)
    first = result.samples.get(0)
    if first is not None:
        _fill_sample(message, first)
    lasts = result.lasts()
    if lasts:
        message.usage.prompt_tokens = lasts[0].prompt_tokens
        message.usage.cached_tokens = lasts[0].cached_tokens
        message.usage.completion_tokens = sum(last.completion_tokens for last in lasts)
        for last in lasts:
            _add_spec_decode(message.usage, last)
    if len(result.samples) > 1:
        for index, sample in result.in_order():
            entry = message.samples.add(index=index)
            _fill_sample(entry, sample)
            entry.completion_tokens = sample.last.completion_tokens if sample.last else 0
    if result.prompt_logprobs is not None:
        message.prompt_logprobs.extend(_logprobs(result.prompt_logprobs))
    return message


def model_info(
    facts: ModelFacts, lora_adapters: list[LoraAdapter], tokenizer_sha256: str
) -> pb.GetModelInfoResponse:
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
        default_sampling_params_json=json.dumps(dict(facts.default_sampling_params)),
        max_num_seqs=facts.max_num_seqs,
        bos_token_id=facts.bos_token_id,
        pad_token_id=facts.pad_token_id,
        architectures=facts.architectures,
        is_generation=facts.is_generation,
        lora_adapters=[adapter.name for adapter in lora_adapters],
        tokenizer_sha256=tokenizer_sha256,
        media_limits=facts.media_limits,
        media_url_schemes=url_schemes(facts),
    )


def loads(ranks: list[RankLoad], in_flight: int) -> pb.GetLoadsResponse:
    message = pb.GetLoadsResponse(requests_in_flight=in_flight)
    for rank in ranks:
        entry = message.ranks.add(
            dp_rank=rank.dp_rank,
            running_requests=rank.running_requests,
            waiting_requests=rank.waiting_requests,
            kv_cache_usage_percent=rank.kv_cache_usage * 100.0,
        )
        if rank.measured_at is not None:  # unset: not reported yet, figures unknown
            entry.measured_at.FromNanoseconds(int(rank.measured_at * 1e9))
    return message


def tokenizer_chunks(
    files: list[tuple[str, bytes]], digest: str
) -> Iterator[pb.GetTokenizerResponse]:
    """Each file in chunks, then a last message with the digest of the whole (see the proto)."""
    for name, data in files:
        for start in range(0, max(len(data), 1), TOKENIZER_CHUNK_BYTES):
            yield pb.GetTokenizerResponse(
                file_name=name, data=data[start : start + TOKENIZER_CHUNK_BYTES]
            )
    yield pb.GetTokenizerResponse(sha256=digest, file_count=len(files))


def embedding(request_id: str, result: Embedding) -> pb.EmbedResponse:
    return pb.EmbedResponse(
        request_id=request_id, embedding=result.values, prompt_tokens=result.prompt_tokens
    )


def lora_adapters(adapters: list[LoraAdapter]) -> pb.ListLoraAdaptersResponse:
    return pb.ListLoraAdaptersResponse(
        adapters=[pb.LoraAdapter(name=a.name, path=a.path) for a in adapters]
    )
