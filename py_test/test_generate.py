"""Generate / GenerateStream behaviour over a real grpc.aio channel, mock engine in-process.

The mock's output is token i = (last prompt token + 1 + i) mod vocab_size and a
token's text is " <id>", so every expectation below is exact.
"""

from __future__ import annotations

import grpc
import pytest

from vllm_router.proto import vllm_engine_pb2 as pb
from vllm_router.server import ServerConfig

from harness import Harness, StartServer, collect_stream, read_rest, request, wait_until


async def test_token_prompt_generates_exact_tokens_text_and_usage(mock: Harness) -> None:
    response = await mock.stub.Generate(request([10, 11, 12], max_tokens=5))
    assert list(response.output_token_ids) == [13, 14, 15, 16, 17]
    assert response.output_text == " 13 14 15 16 17"
    assert response.finish_reason == "length"
    assert response.WhichOneof("matched_stop") is None
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (3, 5)


async def test_text_prompt_is_a_fallback_only(mock: Harness) -> None:
    text_only = pb.GenerateRequest(
        prompt_text="AB", sampling_params=pb.SamplingParams(max_tokens=2)
    )
    response = await mock.stub.Generate(text_only)
    assert list(response.output_token_ids) == [67, 68]  # "B" is byte 66
    # Tokenized before admission: the engine only ever sees token ids.
    assert mock.engine.last_request.prompt_token_ids == [65, 66]
    assert mock.engine.last_request.prompt_text is None
    assert response.usage.prompt_tokens == 2

    both = pb.GenerateRequest(
        prompt_token_ids=[5], prompt_text="AB", sampling_params=pb.SamplingParams(max_tokens=2)
    )
    response = await mock.stub.Generate(both)
    assert list(response.output_token_ids) == [6, 7]
    assert mock.engine.last_request.prompt_token_ids == [5]


async def test_text_prompts_get_every_prompt_check(start_mock: StartServer) -> None:
    harness = await start_mock(ServerConfig(port=0, max_prompt_tokens=4), max_model_len=8)
    for text, needle in (("ABCDE", "--max-prompt-tokens"), ("AB", "max_tokens")):
        req = pb.GenerateRequest(prompt_text=text, sampling_params=pb.SamplingParams(max_tokens=7))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await harness.stub.Generate(req)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert needle in err.value.details() and "prompt_text" in err.value.details()


async def test_no_prompt_is_invalid_argument(mock: Harness) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await mock.stub.Generate(request(None, max_tokens=2))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt_token_ids" in err.value.details()


async def test_stream_concatenation_equals_unary_and_engine_steps(start_mock: StartServer) -> None:
    harness = await start_mock(tokens_per_step=3)
    req = request([100], max_tokens=10)
    messages = await collect_stream(harness.stub, req)
    unary = await harness.stub.Generate(req)
    expected = list(range(101, 111))
    # Several tokens per engine step arrive together: one message per step.
    assert [list(m.token_ids) for m in messages] == [
        [101, 102, 103],
        [104, 105, 106],
        [107, 108, 109],
        [110],
    ]
    streamed = [t for m in messages for t in m.token_ids]
    assert streamed == list(unary.output_token_ids) == expected
    assert "".join(m.text_delta for m in messages) == unary.output_text
    assert [m.is_finished for m in messages] == [False, False, False, True]
    assert [m.usage.completion_tokens for m in messages] == [3, 6, 9, 10]
    last = messages[-1]
    assert (last.finish_reason, last.usage.prompt_tokens, last.usage.completion_tokens) == (
        "length",
        1,
        10,
    )
    assert all(not m.finish_reason for m in messages[:-1])


async def test_token_id_zero_is_a_real_token(start_mock: StartServer) -> None:
    harness = await start_mock(vocab_size=1000)
    messages = await collect_stream(harness.stub, request([999], max_tokens=2))
    assert [t for m in messages for t in m.token_ids] == [0, 1]
    unary = await harness.stub.Generate(request([999], max_tokens=2))
    assert list(unary.output_token_ids) == [0, 1]


async def test_eos_finishes_with_stop_and_reports_the_eos_id(mock: Harness) -> None:
    # eos_token_id is 2: a prompt ending in 31999 yields 0, 1, 2(EOS).
    messages = await collect_stream(mock.stub, request([31999], max_tokens=10))
    assert [t for m in messages for t in m.token_ids] == [0, 1, 2]
    last = messages[-1]
    assert (last.finish_reason, last.stop_token_id) == ("stop", 2)
    assert last.WhichOneof("matched_stop") == "stop_token_id"


async def test_ignore_eos_and_min_tokens_keep_generating(mock: Harness) -> None:
    ignored = await mock.stub.Generate(request([31999], max_tokens=5, ignore_eos=True))
    assert list(ignored.output_token_ids) == [0, 1, 2, 3, 4]
    assert ignored.finish_reason == "length"
    held = await mock.stub.Generate(request([31999], max_tokens=5, min_tokens=4))
    assert list(held.output_token_ids) == [0, 1, 2, 3, 4]


async def test_stop_token_id_and_stop_string(mock: Harness) -> None:
    by_id = await mock.stub.Generate(request([10], max_tokens=10, stop_token_ids=[14]))
    assert list(by_id.output_token_ids) == [11, 12, 13, 14]
    assert (by_id.finish_reason, by_id.stop_token_id) == ("stop", 14)

    by_str = await mock.stub.Generate(request([10], max_tokens=10, stop=[" 13"]))
    assert list(by_str.output_token_ids) == [11, 12, 13]
    assert by_str.output_text == " 11 12"
    assert (by_str.finish_reason, by_str.stop_str) == ("stop", " 13")

    kept = await mock.stub.Generate(
        request([10], max_tokens=10, stop=[" 13"], include_stop_str_in_output=True)
    )
    assert kept.output_text == " 11 12 13"

    streamed = await collect_stream(mock.stub, request([10], max_tokens=10, stop=[" 13"]))
    assert streamed[-1].stop_str == " 13"
    assert "".join(m.text_delta for m in streamed) == " 11 12"


async def test_stop_string_spanning_tokens_and_steps(start_mock: StartServer) -> None:
    for tokens_per_step in (1, 2, 5):
        harness = await start_mock(tokens_per_step=tokens_per_step)
        cut = await harness.stub.Generate(request([10], max_tokens=10, stop=[" 12 13"]))
        assert (cut.output_text, cut.stop_str) == (" 11", " 12 13"), tokens_per_step
        kept = await harness.stub.Generate(
            request([10], max_tokens=10, stop=[" 12 13"], include_stop_str_in_output=True)
        )
        assert kept.output_text == " 11 12 13"
        assert list(kept.output_token_ids) == [11, 12, 13]


async def test_skip_detokenize_returns_ids_without_text(mock: Harness) -> None:
    req = request([10], max_tokens=3)
    req.skip_detokenize = True
    response = await mock.stub.Generate(req)
    assert list(response.output_token_ids) == [11, 12, 13]
    assert response.output_text == ""
    assert mock.engine.last_request.detokenize is False


async def test_logprobs_align_with_tokens(mock: Harness) -> None:
    messages = await collect_stream(mock.stub, request([10], max_tokens=3, logprobs=2))
    entries = [lp for m in messages for lp in m.logprobs]
    for message in messages:
        assert [lp.token_id for lp in message.logprobs] == list(message.token_ids)
    # The mock's values: -0.5 for the sampled token, alternative j is (id + j, -0.5 - j).
    assert [(e.token_id, e.logprob) for e in entries] == [(11, -0.5), (12, -0.5), (13, -0.5)]
    for entry in entries:
        top = [(t.token_id, t.logprob) for t in entry.top_logprobs]
        assert top == [(entry.token_id, -0.5), (entry.token_id + 1, -1.5)]
    unary = await mock.stub.Generate(request([10], max_tokens=3, logprobs=0))
    assert [(e.token_id, e.logprob, len(e.top_logprobs)) for e in unary.logprobs] == [
        (11, -0.5, 0),
        (12, -0.5, 0),
        (13, -0.5, 0),
    ]
    without = await mock.stub.Generate(request([10], max_tokens=3))
    assert len(without.logprobs) == 0


async def test_request_id_generated_and_echoed_on_every_message(mock: Harness) -> None:
    messages = await collect_stream(mock.stub, request([10], max_tokens=4))
    ids = {m.request_id for m in messages}
    assert len(ids) == 1 and len(ids.pop()) == 32
    named = await collect_stream(mock.stub, request([10], request_id="abc", max_tokens=4))
    assert {m.request_id for m in named} == {"abc"}
    unary = await mock.stub.Generate(request([10], request_id="abc", max_tokens=2))
    assert unary.request_id == "abc"  # free again once the first one finished


async def test_duplicate_request_id_in_flight_is_already_exists(start_mock: StartServer) -> None:
    harness = await start_mock(step_delay=0.05)
    stream = harness.stub.GenerateStream(request([10], request_id="dup", max_tokens=50))
    await stream.read()
    with pytest.raises(grpc.aio.AioRpcError) as unary_err:
        await harness.stub.Generate(request([10], request_id="dup", max_tokens=2))
    with pytest.raises(grpc.aio.AioRpcError) as stream_err:
        await collect_stream(harness.stub, request([10], request_id="dup", max_tokens=2))
    for err in (unary_err, stream_err):
        assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert "'dup'" in err.value.details()
    # The first request is unaffected.
    rest = await read_rest(stream)
    assert rest[-1].is_finished and rest[-1].usage.completion_tokens == 50


async def test_client_cancel_aborts_the_engine_request(start_mock: StartServer) -> None:
    harness = await start_mock(step_delay=0.05)
    stream = harness.stub.GenerateStream(request([10], request_id="gone", max_tokens=1000))
    first = await stream.read()
    assert first.token_ids
    assert harness.engine.load().running_requests == 1
    stream.cancel()
    await wait_until(lambda: harness.engine.load().running_requests == 0)
    load = harness.engine.load()
    assert (load.running_requests, load.waiting_requests) == (0, 0)
    assert "gone" in harness.engine.aborted_ids
    assert harness.server.requests.in_flight == frozenset()


async def test_deadline_aborts_the_engine_request(start_mock: StartServer) -> None:
    harness = await start_mock(step_delay=0.05)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await harness.stub.Generate(request([10], request_id="late", max_tokens=1000), timeout=0.3)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await wait_until(lambda: "late" in harness.engine.aborted_ids)
    load = harness.engine.load()
    assert (load.running_requests, load.waiting_requests) == (0, 0)
    await wait_until(lambda: not harness.server.requests.in_flight)


async def test_cancel_while_waiting_for_a_slot_leaves_nothing(start_mock: StartServer) -> None:
    harness = await start_mock(step_delay=0.05, max_num_seqs=1)
    running = harness.stub.GenerateStream(request([10], request_id="r", max_tokens=1000))
    await running.read()
    waiting = harness.stub.GenerateStream(request([10], request_id="w", max_tokens=5))
    await wait_until(lambda: harness.engine.load().waiting_requests == 1)
    waiting.cancel()
    await wait_until(lambda: harness.engine.load().waiting_requests == 0)
    running.cancel()
    await wait_until(lambda: harness.engine.load().running_requests == 0)
    # The slot of the cancelled requests is free again.
    response = await harness.stub.Generate(request([10], max_tokens=2), timeout=5)
    assert list(response.output_token_ids) == [11, 12]


async def test_dp_rank_is_passed_through_and_range_checked(start_mock: StartServer) -> None:
    harness = await start_mock(dp_size=2)
    req = request([10], max_tokens=1)
    req.dp_rank = 1
    await harness.stub.Generate(req)
    assert harness.engine.last_request.dp_rank == 1
    req.dp_rank = 2
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await harness.stub.Generate(req)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "dp_rank 2" in err.value.details() and "dp_size 2" in err.value.details()
    unset = request([10], max_tokens=1)
    await harness.stub.Generate(unset)
    assert harness.engine.last_request.dp_rank is None


async def test_metrics_come_from_the_engine_scheduler(start_mock: StartServer) -> None:
    harness = await start_mock(step_delay=0.02, max_num_seqs=1)
    first_stream = harness.stub.GenerateStream(request([10], max_tokens=20))
    first = await first_stream.read()
    assert (first.metrics.running_requests, first.metrics.waiting_requests) == (1, 0)
    assert first.metrics.kv_cache_usage_percent > 0
    queued_stream = harness.stub.GenerateStream(request([10], max_tokens=2))
    await wait_until(lambda: harness.engine.load().waiting_requests == 1)
    rest = await read_rest(first_stream)
    last = rest[-1]
    assert last.is_finished
    assert (last.metrics.running_requests, last.metrics.waiting_requests) == (1, 1)
    # Metrics ride on the first and the last message only.
    assert all(not m.HasField("metrics") for m in rest[:-1])
    queued = await read_rest(queued_stream)
    assert (queued[0].metrics.running_requests, queued[0].metrics.waiting_requests) == (1, 0)
    idle = await harness.stub.Generate(request([10], max_tokens=1))
    assert (idle.metrics.running_requests, idle.metrics.waiting_requests) == (0, 0)
