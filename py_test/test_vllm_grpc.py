"""vLLM's official contract (vllm.grpc.engine.VllmEngine) on the mock engine, same server.

Message shapes follow vLLM's own --grpc server: a chunk per step (delta tokens; the router
sums completion_tokens), a `complete` per finished sample; non-streamed, one `complete` per
sample with all its tokens.
"""

from __future__ import annotations

import os
from pathlib import Path

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc

from harness import Harness, StartServer, read_rest, request, wait_until


def _generate(ids: list[int], stream: bool = True, **sampling: object) -> vpb.GenerateRequest:
    return vpb.GenerateRequest(
        request_id="",
        tokenized=vpb.TokenizedInput(input_ids=ids),
        sampling_params=vpb.SamplingParams(**sampling),
        stream=stream,
    )


def _stub(harness: Harness) -> vpb_grpc.VllmEngineStub:
    return vpb_grpc.VllmEngineStub(harness.channel)


async def _all(call: object) -> list:
    return [message async for message in call]  # type: ignore[attr-defined]


async def test_streamed_chunks_then_complete(mock: Harness) -> None:
    messages = await _all(_stub(mock).Generate(_generate([10], max_tokens=3)))
    kinds = [m.WhichOneof("response") for m in messages]
    assert kinds == ["chunk", "chunk", "chunk", "complete"]
    assert [list(m.chunk.token_ids) for m in messages[:3]] == [[11], [12], [13]]
    assert all(m.chunk.completion_tokens == 1 and m.chunk.prompt_tokens == 1 for m in messages[:3])
    final = messages[-1].complete
    assert (final.finish_reason, list(final.output_ids)) == ("length", [13])


async def test_unary_is_one_complete_per_sample_with_every_token(mock: Harness) -> None:
    request = _generate([10], stream=False, max_tokens=3, n=2, temperature=0.7)
    messages = await _all(_stub(mock).Generate(request))
    assert [m.WhichOneof("response") for m in messages] == ["complete", "complete"]
    assert [(m.complete.index, list(m.complete.output_ids)) for m in messages] == [
        (0, [11, 12, 13]),
        (1, [12, 13, 14]),
    ]
    assert all(m.complete.completion_tokens == 3 for m in messages)


async def test_matched_stop_and_logprobs(mock: Harness) -> None:
    stub = _stub(mock)
    by_id = await _all(stub.Generate(_generate([10], False, max_tokens=9, stop_token_ids=[12])))
    assert by_id[0].complete.matched_token_id == 12
    eos = await _all(stub.Generate(_generate([31999], False, max_tokens=9)))  # 0, 1, 2 (EOS)
    assert list(eos[0].complete.output_ids) == [0, 1, 2]
    assert eos[0].complete.WhichOneof("matched_stop") is None  # vLLM reports no match for EOS
    by_str = await _all(stub.Generate(_generate([10], False, max_tokens=9, stop=[" 13"])))
    assert by_str[0].complete.matched_stop_str == " 13"
    logprobs = await _all(stub.Generate(_generate([10], False, max_tokens=2, logprobs=2)))
    lp = logprobs[0].complete.output_logprobs
    assert (list(lp.token_ids), list(lp.token_logprobs)) == ([11, 12], [-0.5, -0.5])
    assert [list(t.token_ids) for t in lp.top_logprobs] == [[11, 12], [12, 13]]


async def test_one_request_id_space_across_both_contracts(start_mock: StartServer) -> None:
    harness = await start_mock(step_delay=0.02)
    ours = harness.stub.GenerateStream(request([10], "shared", max_tokens=500))
    await ours.read()
    theirs = _generate([10], max_tokens=2)
    theirs.request_id = "shared"
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _all(_stub(harness).Generate(theirs))
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    await _stub(harness).Abort(vpb.AbortRequest(request_ids=["shared"]))
    last = (await read_rest(ours))[-1]
    assert last.finish_reason == "abort"
    await wait_until(lambda: not harness.server.requests.in_flight)


def _this_hosts_shm() -> str:
    boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    return f"{boot_id}:{os.stat('/dev/shm').st_dev}"


async def test_info_loads_health_and_flush(mock: Harness) -> None:
    stub = _stub(mock)
    info = await stub.GetModelInfo(vpb.GetModelInfoRequest())
    assert (info.is_generation, info.max_context_length, info.vocab_size) == (True, 4096, 32000)
    assert list(info.eos_token_ids) == [2] and info.served_model_name == "mock-model"
    server = await stub.GetServerInfo(vpb.GetServerInfoRequest())
    assert (server.server_type, server.data_parallel_size, server.active_requests) == (
        "vllm-grpc", 1, 0,
    )  # fmt: skip
    # As vLLM's server fills them for a text model: no reasoning parser, so a grammar
    # binds from the first token; this host's /dev/shm; the mock's dtype is unknown.
    assert (server.constrained_decoding_start, server.engine_reasoning_parser) == (
        "first_token", "",
    )  # fmt: skip
    assert server.shm_namespace_id == _this_hosts_shm()
    assert server.multimodal_encoder_dtype == ""
    loads = await stub.GetLoads(vpb.GetLoadsRequest())
    assert loads.dp_rank_count == 1 and loads.loads[0].num_running_reqs == 0
    assert (await stub.HealthCheck(vpb.HealthCheckRequest())).healthy
    assert (await stub.FlushCache(common_pb2.FlushCacheRequest())).success


async def test_clear_statuses_for_what_cannot_be_served(mock: Harness) -> None:
    stub = _stub(mock)
    media = _generate([10], max_tokens=2)
    media.media_refs.items.add(modality=common_pb2.IMAGE, url="http://example.invalid/cat.png")
    cases = [
        (stub.Generate(media), grpc.StatusCode.INVALID_ARGUMENT, "takes no media"),
        (stub.Generate(vpb.GenerateRequest()), grpc.StatusCode.INVALID_ARGUMENT, "empty"),
        (stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest()),
         grpc.StatusCode.UNIMPLEMENTED, "KV cache events"),
        (stub.GetTokenizer(common_pb2.GetTokenizerRequest()), grpc.StatusCode.UNIMPLEMENTED,
         "mock"),
    ]  # fmt: skip
    bad_json = _generate([10], max_tokens=2)
    bad_json.kv_transfer_params_json = "{nope"
    cases.append((stub.Generate(bad_json), grpc.StatusCode.INVALID_ARGUMENT, "not JSON"))
    for call, code, needle in cases:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _all(call)
        assert err.value.code() == code and needle in err.value.details(), err.value.details()
    for unary in (
        stub.StartProfile(common_pb2.StartProfileRequest()),
        stub.Embed(vpb.EmbedRequest(tokenized=vpb.TokenizedInput(input_ids=[1]))),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await unary
        assert err.value.code() in (
            grpc.StatusCode.UNIMPLEMENTED,
            grpc.StatusCode.FAILED_PRECONDITION,
        )
    assert mock.server.requests.in_flight == frozenset()


async def test_truncate_prompt_tokens_keeps_the_last(mock: Harness) -> None:
    request = _generate([5, 6, 7, 8], False, max_tokens=1, truncate_prompt_tokens=2)
    reply = (await _all(_stub(mock).Generate(request)))[0].complete
    assert reply.prompt_tokens == 2 and mock.engine.last_request.prompt_token_ids == [7, 8]
