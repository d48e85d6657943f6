"""Our native contract against vLLM's Rust front end over gRPC, directly: what vllm-router does
not send (logprobs, candidates, prompt scores, text prompts, LoRA, unary Generate, the Control
RPCs) and the status codes for bad input. Same model, same engine flags (`real` and
`vllm_rs_reference`): the same messages, in the same order."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from vllm_router.core import lora_paths
from vllm_router.proto import vllm_native_pb2 as npb
from vllm_router.proto import vllm_native_pb2_grpc as npb_grpc

import real_engine
from harness import Harness, real_engine_idle, wait_until

pytestmark = pytest.mark.vllm

OURS_LORA = "native-lora"  # the same adapter vllm-rs preloads as real_engine.LORA_NAME


def _round(values: Any) -> list[float]:
    return [round(v, 2) if math.isfinite(v) else v for v in values]


def _candidates(entries: Any) -> list[list[tuple[int, float, int]]]:
    return [[(t.id, round(t.logprob, 2), t.rank) for t in c.tokens] for c in entries]


def normalized(message: npb.GenerateResponse) -> tuple:
    """A message as a client reads it (scores to 2 decimals: two engine processes)."""
    info = message.prompt_info if message.HasField("prompt_info") else None
    out = message.outputs if message.HasField("outputs") else None
    finish = out.finish_info if out is not None and out.HasField("finish_info") else None
    return (
        None if info is None else (info.num_prompt_tokens, list(info.token_ids),
                                   _round(info.logprobs), list(info.ranks),
                                   _candidates(info.candidate_tokens)),
        None if out is None else (out.index, out.text, out.num_tokens, list(out.token_ids),
                                  _round(out.logprobs), list(out.ranks),
                                  _candidates(out.candidate_tokens)),
        None if finish is None else (finish.num_output_tokens, finish.finish_reason,
                                     finish.WhichOneof("stop_reason"),
                                     getattr(finish, finish.WhichOneof("stop_reason") or "index",
                                             None)),
    )  # fmt: skip


@pytest.fixture(scope="module")
async def reference(vllm_rs_reference: str) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(vllm_rs_reference) as channel:
        yield channel


async def _stream(channel: grpc.aio.Channel, req: npb.GenerateRequest) -> tuple | str:
    """The prompt's message, then each sequence's messages joined (how many engine steps a
    message carries depends on how fast its reader is), and its finish."""
    try:
        call = npb_grpc.InferenceStub(channel).GenerateStream(req)
        messages = [normalized(m) async for m in call]
    except grpc.aio.AioRpcError as exc:
        return exc.code().name
    first, *rest = messages
    assert first[1:] == (None, None), "the first message carries the prompt's facts only"
    assert all(info is None and output is not None for info, output, _ in rest)
    joined: dict[int, list] = {}
    for _, output, finish in rest:
        index, text, count, ids, logprobs, ranks, candidates = output
        seq = joined.setdefault(index, ["", 0, [], [], [], [], None])
        seq[0] += text
        seq[1] += count
        for at, values in ((2, ids), (3, logprobs), (4, ranks), (5, candidates)):
            seq[at] += values
        assert seq[6] is None, "nothing after a sequence's finish"
        seq[6] = finish
    assert all(seq[6] is not None for seq in joined.values()), "every sequence finishes"
    return first[0], sorted((i, tuple(map(str, seq))) for i, seq in joined.items())


def _ids(ids: list[int], max_new: int = 8, **fields: Any) -> npb.GenerateRequest:
    fields.setdefault("stopping", npb.StoppingCriteria(max_new_tokens=max_new))
    req = npb.GenerateRequest(**fields)
    req.token_ids.ids.extend(ids)
    return req


def _response(**fields: Any) -> npb.ResponseOptions:
    return npb.ResponseOptions(output_token_ids=True, **fields)


PROMPT = [1, 300, 301, 302, 303, 304]


def cases() -> dict[str, npb.GenerateRequest]:
    top3 = npb.CandidateTokens(top_n=3)
    return {
        "greedy": _ids(PROMPT, temperature=0, response=_response()),
        "unset temperature is greedy": _ids(PROMPT, response=_response()),
        "text prompt echoed": npb.GenerateRequest(
            text="Hello worker", temperature=0,
            stopping=npb.StoppingCriteria(max_new_tokens=6),
            response=_response(prompt_token_ids=True)),
        "text off": _ids(PROMPT, temperature=0, response=_response(output_text=False)),
        "seeded": _ids(PROMPT, 12, temperature=0.9,
                       sampling=npb.RandomSampling(seed=11, top_k=30, top_p=0.95),
                       response=_response()),
        "logprobs": _ids(PROMPT, 5, temperature=0, response=_response(output_logprobs=True)),
        "logprobs top 3": _ids(PROMPT, 5, temperature=0, response=_response(
            output_logprobs=True, output_candidates=top3)),
        "logprobs by token id": _ids(PROMPT, 5, temperature=0, response=_response(
            output_logprobs=True,
            output_candidates=npb.CandidateTokens(token_ids=npb.TokenIds(ids=[5, 9, 300])))),
        "prompt logprobs top 2": _ids(PROMPT, 2, temperature=0, response=_response(
            prompt_logprobs=True, prompt_candidates=npb.CandidateTokens(top_n=2))),
        "stop string kept": _ids(PROMPT, 30, temperature=0, stopping=npb.StoppingCriteria(
            max_new_tokens=30, stop_strings=["e"], include_stop_strings=True),
            response=_response()),
        "min tokens": _ids(PROMPT, temperature=0, stopping=npb.StoppingCriteria(
            max_new_tokens=10, min_new_tokens=10), response=_response()),
        "bypass the prefix cache, salted": _ids(PROMPT, 4, temperature=0, kv=npb.KVCacheParameters(
            bypass_prefix_cache=True, cache_salt="tenant-a"), response=_response()),
        "truncated prompt": _ids(PROMPT, 4, temperature=0, truncate_prompt_tokens=3,
                                 response=_response(prompt_token_ids=True)),
        # Bad input: the same status code.
        "empty prompt": _ids([], temperature=0),
        "prompt over the context": _ids([300] * 300, temperature=0),
        "temperature out of range": _ids(PROMPT, temperature=5),
        "top_p out of range": _ids(PROMPT, temperature=1, sampling=npb.RandomSampling(top_p=2)),
        "min over max": _ids(PROMPT, temperature=0, stopping=npb.StoppingCriteria(
            max_new_tokens=2, min_new_tokens=5)),
        "too many logprobs": _ids(PROMPT, temperature=0, response=_response(
            output_logprobs=True, output_candidates=npb.CandidateTokens(top_n=50))),
        "whole-vocabulary logprobs": _ids(PROMPT, temperature=0, response=_response(
            output_logprobs=True, output_candidates=npb.CandidateTokens(all=True))),
        "prompt candidates by id": _ids(PROMPT, temperature=0, response=_response(
            prompt_logprobs=True,
            prompt_candidates=npb.CandidateTokens(token_ids=npb.TokenIds(ids=[5])))),
        "unknown model": _ids(PROMPT, temperature=0, model="no-such-model"),
        "unknown LoRA": _ids(PROMPT, temperature=0, lora_name="no-such-adapter"),
        "truncation within the context": _ids(PROMPT, 100, temperature=0,
                                              truncate_prompt_tokens=200, response=_response()),
        "truncation past the context": _ids(PROMPT, temperature=0, truncate_prompt_tokens=300),
    }  # fmt: skip


async def test_same_messages_as_vllm_rs(
    real: Harness, reference: grpc.aio.Channel, figures
) -> None:
    mismatches = []
    for name, req in cases().items():
        ours, theirs = await _stream(real.channel, req), await _stream(reference, req)
        if ours != theirs:
            mismatches.append(f"{name}:\n  ours   {ours}\n  theirs {theirs}")
    assert not mismatches, "\n".join(mismatches)
    await wait_until(lambda: real_engine_idle(real), 10.0, "the engine to be idle")
    figures(f"{len(cases())} native requests: the same messages or status as vllm-rs")


async def test_unary_generate_as_vllm_rs(real: Harness, reference: grpc.aio.Channel) -> None:
    req = _ids(PROMPT, 6, temperature=0, response=_response(prompt_token_ids=True,
                                                            output_logprobs=True))  # fmt: skip
    ours = await npb_grpc.InferenceStub(real.channel).Generate(req)
    theirs = await npb_grpc.InferenceStub(reference).Generate(req)
    assert normalized(ours) == normalized(theirs)
    assert ours.outputs.num_tokens == 6 and ours.prompt_info.num_prompt_tokens == len(PROMPT)


async def test_lora_requests_as_vllm_rs(real: Harness, reference: grpc.aio.Channel) -> None:
    ctl = npb_grpc.ControlStub(real.channel)
    adapter = str(real_engine.tiny_lora())
    loaded = await ctl.LoadLora(npb.LoadLoraRequest(lora_name=OURS_LORA, source_path=adapter))
    try:
        assert (loaded.adapter.lora_name, loaded.adapter.source_path) == (OURS_LORA, adapter)
        listed = await ctl.ListLoras(npb.ListLorasRequest())
        assert OURS_LORA in [a.lora_name for a in listed.adapters]
        ours = await _stream(real.channel, _ids(PROMPT, 8, temperature=0, lora_name=OURS_LORA,
                                                response=_response()))  # fmt: skip
        theirs = await _stream(reference, _ids(PROMPT, 8, temperature=0, response=_response(),
                                                lora_name=real_engine.LORA_NAME))  # fmt: skip
        base = await _stream(real.channel, _ids(PROMPT, 8, temperature=0, response=_response()))
        assert ours == theirs and ours != base
    finally:
        unloaded = await ctl.UnloadLora(npb.UnloadLoraRequest(lora_name=OURS_LORA))
    assert unloaded.adapter.lora_name == OURS_LORA
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await ctl.UnloadLora(npb.UnloadLoraRequest(lora_name=OURS_LORA))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


async def _load_lora(channel: grpc.aio.Channel, path: str) -> str:
    ctl = npb_grpc.ControlStub(channel)
    try:
        loaded = await ctl.LoadLora(npb.LoadLoraRequest(lora_name="probe", source_path=path))
    except grpc.aio.AioRpcError as err:
        return f"{err.code().name}: {err.details()}"
    await ctl.UnloadLora(npb.UnloadLoraRequest(lora_name="probe"))
    return f"OK {loaded.adapter.source_path}"


async def test_lora_paths_are_confined_as_vllm_rs_confines_them(
    real: Harness, reference: grpc.aio.Channel, tmp_path: Path
) -> None:
    """Runtime LoadLora on both workers, each allowing the models' folder only (our
    --lora-allowed-path-prefixes, vllm-rs's VLLM_RUNTIME_LORA_ALLOWED_PATH_PREFIXES): the
    same answers, but where a path that does not exist is concerned. vllm-rs 0.33 resolves
    first: a missing path is "must exist" wherever it points; here a missing path outside
    every prefix is "outside" as an existing one is (no answer tells what exists there),
    and one missing under a prefix NOT_FOUND "No adapter found", as vllm-rs 0.34 answers."""
    adapter = real_engine.tiny_lora()
    escape = adapter.parent / "lora-escape"  # a link under the prefix, to a folder outside
    escape.unlink(missing_ok=True)
    escape.symlink_to(tmp_path)
    cases = {
        "the adapter": str(adapter),
        "relative": "./" + adapter.name,
        "outside": "/etc",
        "dot-dot out of the prefix": f"{adapter.parent}/{'../' * len(adapter.parent.parts)}etc",
        "a link out of the prefix": str(escape),
        "missing, outside": "/nonexistent/adapter",
        "missing, under the prefix": f"{adapter.parent}/no-such-adapter",
    }
    try:
        ours = {name: await _load_lora(real.channel, path) for name, path in cases.items()}
        theirs = {name: await _load_lora(reference, path) for name, path in cases.items()}
    finally:
        escape.unlink()
    must_exist = "INVALID_ARGUMENT: Local LoRA adapter path must exist and be accessible."
    assert {name: (ours[name], theirs[name]) for name in cases if ours[name] != theirs[name]} == {
        "missing, outside": (f"INVALID_ARGUMENT: {lora_paths.OUTSIDE}", must_exist),
        "missing, under the prefix": (
            f"NOT_FOUND: No adapter found for {cases['missing, under the prefix']}",
            must_exist,
        ),
    }
    assert ours["the adapter"] == f"OK {adapter}"
    assert ours["relative"] == f"INVALID_ARGUMENT: {lora_paths.NOT_ABSOLUTE}"
    for name in ("outside", "dot-dot out of the prefix", "a link out of the prefix"):
        assert ours[name] == f"INVALID_ARGUMENT: {lora_paths.OUTSIDE}", name


async def test_control_facts_as_vllm_rs(real: Harness, reference: grpc.aio.Channel) -> None:
    ours, theirs = npb_grpc.ControlStub(real.channel), npb_grpc.ControlStub(reference)
    a = await ours.GetServerInfo(npb.GetServerInfoRequest())
    b = await theirs.GetServerInfo(npb.GetServerInfoRequest())
    same = ("engine_version", "api_version", "max_model_len", "kv_block_size", "total_kv_blocks",
            "max_running_requests", "max_batched_tokens", "max_loras")  # fmt: skip
    assert {f: getattr(a, f) for f in same} == {f: getattr(b, f) for f in same}
    assert a.parallelism == b.parallelism
    assert a.rl_capabilities == b.rl_capabilities
    a_model = await ours.GetModelInfo(npb.GetModelInfoRequest())
    b_model = await theirs.GetModelInfo(npb.GetModelInfoRequest())
    assert a_model == b_model
    for rpc in ("IsPaused", "IsSleeping", "GetWeightVersion"):
        request = getattr(npb, f"{rpc}Request")()
        assert await getattr(ours, rpc)(request) == await getattr(theirs, rpc)(request), rpc
    assert await ours.Abort(npb.AbortRequest(request_ids=["nobody"])) == npb.AbortResponse()
    # `real` publishes KV events on an ipc endpoint of its own (vllm-rs's engine publishes none).
    sources = await ours.GetKvEventSources(npb.GetKvEventSourcesRequest())
    (source,) = sources.sources
    assert (source.transport, source.encoding, source.data_parallel_rank) == ("zmq", "msgpack", 0)
    assert source.endpoint.startswith("ipc://")


async def test_sequences_beyond_vllm_rs(real: Harness, reference: grpc.aio.Channel) -> None:
    """num_sequences > 1: vllm-rs refuses it; this worker serves it (a kept difference)."""
    req = _ids(PROMPT, 6, temperature=0.9, sampling=npb.RandomSampling(num_sequences=2, seed=4),
               response=_response())  # fmt: skip
    assert await _stream(reference, req) == "INVALID_ARGUMENT"
    ours = await _stream(real.channel, req)
    assert isinstance(ours, tuple)
    assert [(index, seq[1]) for index, seq in ours[1]] == [(0, "6"), (1, "6")]


@pytest.mark.parametrize(
    ("mode", "finish"), [(npb.PAUSE_MODE_ABORT, npb.ABORTED), (npb.PAUSE_MODE_KEEP, npb.LENGTH)]
)
async def test_pause_and_resume_the_engine(real: Harness, mode: int, finish: int) -> None:
    """PauseGeneration on the real engine: ABORT ends the request in flight (ABORTED), KEEP
    freezes it and it finishes all its tokens after ResumeGeneration."""
    ctl = npb_grpc.ControlStub(real.channel)
    stopping = npb.StoppingCriteria(max_new_tokens=240, ignore_eos=True)
    call = npb_grpc.InferenceStub(real.channel).GenerateStream(
        _ids(PROMPT, temperature=0, stopping=stopping, response=_response())
    )
    await call.read()  # prompt_info
    await call.read()  # the first tokens: running in the engine
    try:
        await ctl.PauseGeneration(npb.PauseGenerationRequest(mode=mode, clear_cache=False))  # type: ignore[arg-type]
        assert (await ctl.IsPaused(npb.IsPausedRequest())).paused
    finally:
        await ctl.ResumeGeneration(npb.ResumeGenerationRequest())
    assert not (await ctl.IsPaused(npb.IsPausedRequest())).paused
    rest = []
    while (message := await call.read()) is not grpc.aio.EOF:
        rest.append(message)
    done = rest[-1].outputs.finish_info
    assert done.finish_reason == finish, done
    if finish == npb.LENGTH:
        assert done.num_output_tokens == 240
    await wait_until(lambda: real_engine_idle(real), 10.0, "the engine to be idle")
    after = await _stream(real.channel, _ids(PROMPT, 3, temperature=0, response=_response()))
    assert isinstance(after, tuple)  # it serves on
