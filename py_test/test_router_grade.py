"""Router-grade features on the mock engine: n, Abort, GetLoads, logit bias, choice, trace
context, and a clear UNIMPLEMENTED for what the mock cannot do. (The real engine's side of
each is in test_real_router_grade.py.)"""

from __future__ import annotations

import json

import grpc
import pytest

from vllm_router.proto import vllm_engine_pb2 as pb

from harness import Harness, StartServer, collect_stream, read_rest, request, wait_until


async def test_n_samples_stream_with_their_index_and_each_finishes(mock: Harness) -> None:
    messages = await collect_stream(mock.stub, request([10], max_tokens=3, n=3))
    by_index: dict[int, list[int]] = {}
    for message in messages:
        by_index.setdefault(message.index, []).extend(message.token_ids)
    # Sample i continues the prompt at 10 + 1 + i.
    assert by_index == {0: [11, 12, 13], 1: [12, 13, 14], 2: [13, 14, 15]}
    finished = [m.index for m in messages if m.is_finished]
    assert sorted(finished) == [0, 1, 2] and messages[-1].is_finished
    assert all(m.usage.completion_tokens == 3 for m in messages if m.is_finished)


async def test_unary_n_returns_every_sample(mock: Harness) -> None:
    response = await mock.stub.Generate(request([10], max_tokens=2, n=2))
    assert list(response.output_token_ids) == [11, 12]
    assert [list(s.output_token_ids) for s in response.samples] == [[11, 12], [12, 13]]
    assert [s.output_text for s in response.samples] == [" 11 12", " 12 13"]
    assert response.usage.completion_tokens == 4


async def test_cancelling_an_n_request_aborts_every_sample(start_mock: StartServer) -> None:
    harness = await start_mock(step_delay=0.02)
    stream = harness.stub.GenerateStream(request([10], "many", max_tokens=1000, n=4))
    await stream.read()
    assert harness.engine.load().running_requests == 1
    stream.cancel()
    await wait_until(lambda: not harness.server.requests.in_flight)
    assert harness.engine.load().running_requests == 0 and "many" in harness.engine.aborted_ids


async def test_abort_ends_exactly_the_named_streams(start_mock: StartServer) -> None:
    harness = await start_mock(step_delay=0.02)
    streams = {
        f"r{i}": harness.stub.GenerateStream(request([10], f"r{i}", max_tokens=60))
        for i in range(5)
    }
    for stream in streams.values():
        await stream.read()
    reply = await harness.stub.Abort(pb.AbortRequest(request_ids=["r1", "r3", "unknown"]))
    assert sorted(reply.aborted_request_ids) == ["r1", "r3"]
    for request_id, stream in streams.items():
        last = (await read_rest(stream))[-1]
        aborted = request_id in ("r1", "r3")
        assert last.is_finished
        assert last.finish_reason == ("abort" if aborted else "length"), request_id
        assert (last.usage.completion_tokens < 60) == aborted
    assert sorted(set(harness.engine.aborted_ids)) == ["r1", "r3"]


async def test_get_loads_idle_busy_and_after(start_mock: StartServer) -> None:
    harness = await start_mock(step_delay=0.02, max_num_seqs=2)
    idle = await harness.stub.GetLoads(pb.GetLoadsRequest())
    assert [(r.dp_rank, r.running_requests, r.waiting_requests) for r in idle.ranks] == [(0, 0, 0)]
    assert idle.requests_in_flight == 0 and idle.ranks[0].measured_at.seconds > 0
    streams = [harness.stub.GenerateStream(request([10], max_tokens=500)) for _ in range(3)]
    # Which two run and which one waits is the transport's doing: calls on one connection may
    # reach the server in any order (they do on --transport native).
    await wait_until(
        lambda: (
            (harness.engine.load().running_requests, harness.engine.load().waiting_requests)
            == (2, 1)
        )
    )
    busy = await harness.stub.GetLoads(pb.GetLoadsRequest())
    assert (busy.ranks[0].running_requests, busy.ranks[0].waiting_requests) == (2, 1)
    assert busy.requests_in_flight == 3 and busy.ranks[0].kv_cache_usage_percent > 0
    for stream in streams:
        stream.cancel()
    await wait_until(lambda: not harness.server.requests.in_flight)
    after = await harness.stub.GetLoads(pb.GetLoadsRequest())
    assert (after.ranks[0].running_requests, after.ranks[0].waiting_requests) == (0, 0)


async def test_logit_bias_forces_and_bans_tokens(mock: Harness) -> None:
    forced = await mock.stub.Generate(request([10], max_tokens=3, logit_bias={500: 100.0}))
    assert list(forced.output_token_ids) == [500, 500, 500]
    banned = await mock.stub.Generate(request([10], max_tokens=3, logit_bias={12: -100.0}))
    assert list(banned.output_token_ids) == [11, 13, 14]
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await mock.stub.Generate(request([10], max_tokens=3, logit_bias={12: 2.5}))
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED and "mock" in err.value.details()


async def test_choice_constraint_emits_the_first_choice(mock: Harness) -> None:
    choice = pb.StructuredOutputs(choice=pb.ChoiceList(choices=["yes", "no"]))
    response = await mock.stub.Generate(request([10], max_tokens=10, structured_outputs=choice))
    assert response.output_text == "yes"
    assert list(response.output_token_ids) == [ord("y"), ord("e"), ord("s"), 2]
    assert (response.finish_reason, response.stop_token_id) == ("stop", 2)


async def test_what_the_mock_cannot_do_is_unimplemented_naming_it(mock: Harness) -> None:
    regex = pb.StructuredOutputs(regex="[a-z]+")
    calls = [
        mock.stub.Generate(request([10], max_tokens=2, prompt_logprobs=1)),
        mock.stub.Generate(request([10], max_tokens=2, structured_outputs=regex)),
        mock.stub.Generate(request([10], max_tokens=2, allowed_token_ids=[3])),
        mock.stub.Generate(pb.GenerateRequest(prompt_token_ids=[10], lora_name="x")),
        mock.stub.ListLoraAdapters(pb.ListLoraAdaptersRequest()),
        mock.stub.LoadLoraAdapter(pb.LoadLoraAdapterRequest(name="a", path="/tmp/a")),
    ]
    for call in calls:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED, err.value.details()
        assert "mock" in err.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in mock.stub.GetTokenizer(pb.GetTokenizerRequest()):
            pass
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    # The mock serves a generation model: Embed is the wrong RPC for it, as on vLLM.
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await mock.stub.Embed(pb.EmbedRequest(prompt_token_ids=[1, 2]))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "pooling" in err.value.details()
    assert mock.server.requests.in_flight == frozenset()


async def test_bad_new_fields_are_invalid_argument(mock: Harness) -> None:
    cases = [
        (request([10], max_tokens=2, n=0), "n must be at least 1"),
        (request([10], max_tokens=2, structured_outputs=pb.StructuredOutputs()), "constraint"),
        (pb.GenerateRequest(prompt_token_ids=[10], priority=3), "scheduling-policy priority"),
        (
            request([10], structured_outputs=pb.StructuredOutputs(choice=pb.ChoiceList())),
            "no choices",
        ),
    ]
    for req, needle in cases:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await mock.stub.Generate(req)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
        assert needle in err.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await mock.stub.LoadLoraAdapter(pb.LoadLoraAdapterRequest(name="a"))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_trace_context_reaches_the_engine(mock: Harness) -> None:
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    metadata = (("traceparent", parent), ("tracestate", "vendor=1"), ("other", "x"))
    await mock.stub.Generate(request([10], max_tokens=1), metadata=metadata)
    assert mock.engine.last_request.trace_headers == {
        "traceparent": parent,
        "tracestate": "vendor=1",
    }
    await mock.stub.Generate(request([10], max_tokens=1))
    assert mock.engine.last_request.trace_headers is None


async def test_model_info_new_fields(start_mock: StartServer) -> None:
    harness = await start_mock(max_num_seqs=7)
    info = await harness.stub.GetModelInfo(pb.GetModelInfoRequest())
    assert info.is_generation and info.max_num_seqs == 7
    assert json.loads(info.default_sampling_params_json) == {}
    assert not info.HasField("bos_token_id") and list(info.lora_adapters) == []


async def test_get_loads_per_rank_on_a_data_parallel_mock(start_mock: StartServer) -> None:
    harness = await start_mock(step_delay=0.02, dp_size=2)
    pinned = request([10], max_tokens=500)
    pinned.dp_rank = 1
    stream = harness.stub.GenerateStream(pinned)
    await stream.read()
    loads = await harness.stub.GetLoads(pb.GetLoadsRequest())
    assert [(r.dp_rank, r.running_requests) for r in loads.ranks] == [(0, 0), (1, 1)]
    stream.cancel()


def test_a_rank_that_has_not_reported_is_unknown_never_idle() -> None:
    from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

    from vllm_router.contracts.vllm_engine_v1 import responses as ours
    from vllm_router.contracts.vllm_grpc_engine import responses as theirs
    from vllm_router.engine import RankLoad

    ranks = [RankLoad(0, 3, 1, 0.5, 1_700_000_000.0), RankLoad(1, 0, 0, 0.0, None)]
    reply = ours.loads(ranks, in_flight=4)
    assert [r.HasField("measured_at") for r in reply.ranks] == [True, False]
    official: vpb.GetLoadsResponse = theirs.loads(ranks, 8, "v")
    assert [load.dp_rank for load in official.loads] == [0]  # left out, not sent as idle
