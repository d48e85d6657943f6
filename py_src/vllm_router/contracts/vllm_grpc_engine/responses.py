"""The neutral engine types -> vllm.grpc.engine / smg.grpc.common messages (pure functions)."""

from __future__ import annotations

import functools
import hashlib
import io
import json
import math
import os
import time
import zipfile
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

from ...core.flight import DirectStepRenderer
from ...core.media_admission import url_schemes
from ...engine import (
    EngineStep,
    KvBlocksRemoved,
    KvBlocksStored,
    KvEventBatch,
    ModelFacts,
    RankLoad,
    TokenLogprob,
)

# The router reads the tokenizer bundle in chunks of this size.
TOKENIZER_CHUNK_BYTES = 64 * 1024


def _top(entry: TokenLogprob) -> tuple[list[int], list[float]]:
    """The k most likely tokens in vLLM's server's order: the chosen token first when it
    is among them (as vLLM's own map lists it), then by rank. vLLM's server takes the
    first k map entries, which drops the k-th best when the chosen token is not among the
    k most likely; here the k most likely are always the ones sent."""
    top = list(entry.top)
    for i, (token_id, _) in enumerate(top):
        if token_id == entry.token_id:
            top.insert(0, top.pop(i))
            break
    return [t for t, _ in top], [lp for _, lp in top]


def output_logprobs(entries: list[TokenLogprob] | None, num_top: int) -> vpb.OutputLogProbs | None:
    if not entries:
        return None
    message = vpb.OutputLogProbs(
        token_logprobs=[e.logprob for e in entries], token_ids=[e.token_id for e in entries]
    )
    if num_top > 0:
        for entry in entries:
            token_ids, values = _top(entry)
            message.top_logprobs.add(token_ids=token_ids, values=values)
    return message


def input_logprobs(entries: list[TokenLogprob] | None, num_top: int) -> vpb.InputLogProbs | None:
    if not entries:
        return None
    message = vpb.InputLogProbs(token_ids=[e.token_id for e in entries])
    for entry in entries:
        value = message.token_logprobs.add()
        if not math.isnan(entry.logprob):  # the first prompt token has none
            value.value = entry.logprob
        if num_top > 0:
            token_ids, values = _top(entry)
            message.top_logprobs.add(token_ids=token_ids, values=values)
    return message


def chunk(
    step: EngineStep, num_top: int, prompt: list[TokenLogprob] | None, num_prompt_top: int
) -> vpb.GenerateResponse:
    """A stream chunk: this step's tokens; completion_tokens counts them (the router sums)."""
    return vpb.GenerateResponse(
        chunk=vpb.GenerateStreamChunk(
            token_ids=step.token_ids,
            prompt_tokens=step.prompt_tokens,
            completion_tokens=len(step.token_ids),
            cached_tokens=step.cached_tokens,
            output_logprobs=output_logprobs(step.logprobs, num_top),
            input_logprobs=input_logprobs(prompt, num_prompt_top),
            index=step.index,
        )
    )


def direct_step_renderer() -> DirectStepRenderer:
    """One stream's `chunk` of a plain step (core/flight.py's DirectStepRenderer): one
    message, rendered again for every step; completion_tokens counts the chunk's own
    tokens, as every chunk's does."""
    response = vpb.GenerateResponse()
    chunk = response.chunk
    chunk.SetInParent()
    token_ids = chunk.token_ids

    def render(ids: list[int], last: EngineStep, completion_tokens: int) -> vpb.GenerateResponse:
        token_ids[:] = ids
        chunk.prompt_tokens = last.prompt_tokens
        chunk.completion_tokens = len(ids)
        chunk.cached_tokens = last.cached_tokens
        chunk.index = last.index
        return response

    return render


def complete(
    last: EngineStep,
    output_ids: list[int],
    logprobs: list[TokenLogprob] | None,
    num_top: int,
    prompt: list[TokenLogprob] | None,
    num_prompt_top: int,
    eos_ids: frozenset[int],
) -> vpb.GenerateResponse:
    """A sample's final message with `output_ids` and their logprobs."""
    message = vpb.GenerateComplete(
        output_ids=output_ids,
        finish_reason=last.finish_reason or "stop",
        prompt_tokens=last.prompt_tokens,
        completion_tokens=len(output_ids),
        cached_tokens=last.cached_tokens,
        output_logprobs=output_logprobs(logprobs, num_top),
        input_logprobs=input_logprobs(prompt, num_prompt_top),
        index=last.index,
    )
    reason = last.stop_reason
    if isinstance(reason, str):
        message.matched_stop_str = reason
    elif reason is not None and reason not in eos_ids:  # vLLM reports no match for EOS
        message.matched_token_id = reason
    if last.spec_decode is not None:  # as vLLM's --grpc server: 0 when vLLM has none
        message.spec_draft_tokens = last.spec_decode.draft_tokens
        message.spec_accepted_tokens = last.spec_decode.accepted_tokens
    if last.kv_transfer_params:
        params = dict(last.kv_transfer_params)
        message.kv_transfer_params_json = json.dumps(params)
        if "remote_host" in params or "remote_port" in params:
            message.kv_transfer_params.remote_host = str(params.get("remote_host") or "")
            message.kv_transfer_params.remote_port = int(params.get("remote_port") or 0)
    return vpb.GenerateResponse(complete=message)


def model_info(facts: ModelFacts) -> vpb.GetModelInfoResponse:
    return vpb.GetModelInfoResponse(
        model_path=facts.model_name,
        is_generation=facts.is_generation,
        max_context_length=facts.max_model_len,
        vocab_size=facts.vocab_size,
        supports_vision="image" in facts.media_limits,
        served_model_name=facts.served_model_name,
        tokenizer_path=facts.tokenizer_path,
        model_type=facts.model_type,
        architectures=facts.architectures,
        eos_token_ids=facts.eos_token_ids,
        pad_token_id=facts.pad_token_id or 0,
        bos_token_id=facts.bos_token_id or 0,
        max_req_input_len=facts.max_model_len,
        default_sampling_params_json=json.dumps(dict(facts.default_sampling_params)),
    )


def server_info(facts: ModelFacts, active: int, started: float) -> vpb.GetServerInfoResponse:
    return vpb.GetServerInfoResponse(
        active_requests=active,
        is_paused=False,
        last_receive_timestamp=time.time(),
        uptime_seconds=time.monotonic() - started,
        server_type="vllm-grpc",
        data_parallel_size=facts.dp_size,
        block_size=facts.block_size,
        max_num_seqs=facts.max_num_seqs,
        # What the router pairs prefill and decode workers by.
        kv_connector=facts.kv_connector,
        kv_role=facts.kv_role,
        kv_engine_id=facts.kv_engine_id,
        kv_cache_dtype=facts.kv_cache_dtype,
        model_dtype=facts.model_dtype,
        # As vLLM's server: the model's dtype for every model, text-only ones too.
        multimodal_encoder_dtype=_encoder_dtype(facts.model_dtype),
        # Where the engine starts a request's grammar on a thinking prompt: the router
        # shapes a forced tool call's grammar by it.
        engine_reasoning_parser=facts.reasoning_parser,
        constrained_decoding_start=GRAMMAR_START[facts.grammar_after_reasoning],
        # A router on the same host may send a worker that advertises it media tensors
        # in /dev/shm instead of inline; this worker reads inline tensors only, so only a
        # worker that takes no media says where its /dev/shm is (as vLLM's server does).
        shm_namespace_id="" if facts.media_limits else shm_namespace_id(),
        **_media_info(facts),
    )


# vLLM's server's constrained_decoding_start labels, by ModelFacts.grammar_after_reasoning.
GRAMMAR_START = {None: "", False: "first_token", True: "after_reasoning"}


def _encoder_dtype(model_dtype: str) -> str:
    """The dtype a router casts media tensors to, without torch's prefix ("" unknown)."""
    dtype = model_dtype.removeprefix("torch.")
    return dtype if dtype in ("float32", "float16", "bfloat16") else ""


@functools.cache
def shm_namespace_id() -> str:
    """Which /dev/shm this process sees, as "<boot id>:<device of /dev/shm>": two processes
    share it when both parts match (one host, one tmpfs), even across containers; ""
    when either cannot be read."""
    try:
        boot_id = Path("/proc/sys/kernel/random/boot_id").read_text(encoding="ascii").strip()
        device = os.stat("/dev/shm").st_dev
    except OSError:
        return ""
    return f"{boot_id}:{device}"


def _media_info(facts: ModelFacts) -> dict[str, Any]:
    """What the router reads to send a worker media: with a non-empty mm_processor it
    forwards image URLs (media_refs, `--mm-processing worker`) for the worker to process,
    as vLLM's server does with its in-process processor on."""
    schemes = url_schemes(facts)
    if not schemes:
        return {}
    return {
        "mm_processor": "inprocess",
        "mm_processor_source": "default",
        "mm_media_ref_schemes": ",".join(schemes),
        "mm_item_limits": ",".join(f"{m}={n}" for m, n in sorted(facts.media_limits.items())),
    }


def loads(
    ranks: list[RankLoad], max_running: int, version: str, kv_tokens: int = 0
) -> vpb.GetLoadsResponse:
    """Every rank that has reported figures: one that has not is left out rather than
    sent as idle (the message has no way to say "unknown"). `kv_tokens`: a rank's KV cache
    in tokens (0: unknown), and from it the tokens in use, as vLLM's --grpc server derives
    them from the cache's usage."""
    return vpb.GetLoadsResponse(
        timestamp=datetime.now(timezone.utc).isoformat(),
        version=version,
        dp_rank_count=len(ranks),
        loads=[
            vpb.SchedulerLoad(
                dp_rank=r.dp_rank,
                num_running_reqs=r.running_requests,
                num_waiting_reqs=r.waiting_requests,
                num_total_reqs=r.running_requests + r.waiting_requests,
                token_usage=r.kv_cache_usage,
                utilization=r.kv_cache_usage,
                max_running_requests=max_running,
                max_total_num_tokens=kv_tokens,
                num_used_tokens=round(max(0.0, r.kv_cache_usage) * kv_tokens),
            )
            for r in ranks
            if r.measured_at is not None
        ],
    )


def kv_event_batch(batch: KvEventBatch, event_ids: Iterator[int]) -> common_pb2.KvEventBatch:
    message = common_pb2.KvEventBatch(sequence_number=batch.sequence, timestamp=batch.timestamp)
    if batch.dp_rank is not None:
        message.dp_rank = batch.dp_rank
    for event in batch.events:
        entry = message.events.add(event_id=next(event_ids))
        if isinstance(event, KvBlocksStored):
            size = event.block_size
            for i, block_hash in enumerate(event.block_hashes):
                block = entry.stored.blocks.add(
                    block_hash=block_hash,
                    token_ids=event.token_ids[i * size : (i + 1) * size],
                    block_size=size,
                )
                if event.lora_id is not None:
                    block.lora_id = event.lora_id
            if event.parent_block_hash is not None:
                entry.stored.parent_block_hash = event.parent_block_hash
        elif isinstance(event, KvBlocksRemoved):
            entry.removed.block_hashes.extend(event.block_hashes)
        else:
            entry.cleared.SetInParent()
    return message


def tokenizer_zip(files: list[tuple[str, bytes]]) -> bytes:
    """The tokenizer files as one zip archive (what the router unpacks)."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in files:
            archive.writestr(name, data)
    return buffer.getvalue()


def tokenizer_chunks(archive: bytes) -> Iterator[common_pb2.GetTokenizerChunk]:
    """The archive in chunks; the last carries the SHA-256 of the whole archive."""
    digest = hashlib.sha256(archive).hexdigest()
    starts = range(0, len(archive), TOKENIZER_CHUNK_BYTES)
    for start in starts:
        last = start == starts[-1]
        yield common_pb2.GetTokenizerChunk(
            data=archive[start : start + TOKENIZER_CHUNK_BYTES], sha256=digest if last else ""
        )
