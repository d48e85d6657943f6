"""GenerateBatch: many requests on one stream, each as on GenerateStream (mock engine).

The mock's output is token i = (last prompt token + 1 + i) mod vocab_size, so every
expectation below is exact. The real engine's per-step batching is proved in
test_real_generate_batch.py.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
from batches import Answers, Requests, generate, read_all, run_batch, until_ended

from vllm_router.proto import vllm_engine_pb2 as pb
from vllm_router.server import ServerConfig

from harness import Harness, StartServer, collect_stream, delta, request, scrape, wait_until


async def test_many_requests_on_one_stream_answer_as_generate_stream(mock: Harness) -> None:
    prompts = {f"r{i}": [100 + 10 * i] for i in range(8)}
    call = mock.stub.GenerateBatch(
        [generate(p, rid, max_tokens=5 + i) for i, (rid, p) in enumerate(prompts.items())]
    )
    answers = Answers()
    await read_all(call, answers)
    assert await call.code() == grpc.StatusCode.OK
    assert answers.errors == {}
    for i, (rid, prompt) in enumerate(prompts.items()):
        single = await collect_stream(mock.stub, request(prompt, max_tokens=5 + i))
        expected = [t for m in single for t in m.token_ids]
        assert answers.tokens(rid) == expected == [prompt[0] + 1 + k for k in range(5 + i)]
        last = answers.last(rid)
        assert (last.is_finished, last.finish_reason) == (True, "length")
        assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (1, 5 + i)
        # Worker load rides on each request's first and last update, as on GenerateStream.
        assert answers.updates[rid][0].HasField("metrics") and last.HasField("metrics")
    assert mock.server.requests.in_flight == frozenset()


async def test_a_bad_request_fails_alone_and_the_stream_goes_on(start_mock: StartServer) -> None:
    harness = await start_mock(ServerConfig(port=0, max_prompt_tokens=4), step_delay=0.01)
    outgoing = Requests()
    call = harness.stub.GenerateBatch(outgoing.stream())
    answers = Answers()
    await outgoing.put(generate([10], "good", max_tokens=30))
    answers.take(await call.read())  # "good" runs
    for bad in (
        generate([10], "", max_tokens=2),  # no id
        generate([10], "good", max_tokens=2),  # in flight
        generate([1, 2, 3, 4, 5], "long", max_tokens=2),  # over --max-prompt-tokens
        generate([10], "bad-sampling", max_tokens=2, temperature=-1.0),
        pb.GenerateBatchRequest(),  # no action
    ):
        await outgoing.put(bad)
    await outgoing.put(generate([20], "after", max_tokens=3))
    await outgoing.put(None)
    await read_all(call, answers)
    assert await call.code() == grpc.StatusCode.OK
    invalid = grpc.StatusCode.INVALID_ARGUMENT.value[0]
    told = sorted((e.request_id, e.code) for e in answers.refused)
    assert told == sorted(
        [("", invalid), ("", invalid), ("good", grpc.StatusCode.ALREADY_EXISTS.value[0]),
         ("long", invalid), ("bad-sampling", invalid)]
    )  # fmt: skip
    assert "--max-prompt-tokens" in answers.refusal("long").message
    assert "temperature" in answers.refusal("bad-sampling").message
    assert "request_id is empty" in answers.refused[0].message
    # The duplicate was refused; the request in flight under that id goes on.
    assert answers.errors == {}
    assert answers.tokens("good") == [11 + k for k in range(30)]
    assert answers.last("good").finish_reason == "length"
    assert answers.tokens("after") == [21, 22, 23]


async def test_every_refusal_is_told_with_its_code(start_mock: StartServer) -> None:
    harness = await start_mock(step_delay=0.01)
    call = harness.stub.GenerateBatch(
        [
            generate([10], "dup", max_tokens=20),
            generate([10], "dup", max_tokens=2),
            generate([10], "", max_tokens=2),
            pb.GenerateBatchRequest(),
        ]
    )
    answers = Answers()
    await read_all(call, answers)
    assert answers.errors == {}
    assert sorted((e.request_id, e.code) for e in answers.refused) == sorted(
        [
            ("dup", grpc.StatusCode.ALREADY_EXISTS.value[0]),
            ("", grpc.StatusCode.INVALID_ARGUMENT.value[0]),
            ("", grpc.StatusCode.INVALID_ARGUMENT.value[0]),
        ]
    )
    assert len(answers.tokens("dup")) == 20


async def test_abort_by_id_ends_that_request_only(start_mock: StartServer) -> None:
    harness = await start_mock(step_delay=0.02)
    other = harness.stub.GenerateStream(request([50], request_id="elsewhere", max_tokens=1000))
    await other.read()
    outgoing = Requests()
    call = harness.stub.GenerateBatch(outgoing.stream())
    answers = Answers()
    await outgoing.put(generate([10], "stop-me", max_tokens=1000))
    await outgoing.put(generate([20], "keep", max_tokens=40))
    while not (answers.updates.get("stop-me") and answers.updates.get("keep")):
        answers.take(await call.read())
    # Ids of other streams are not this stream's to abort.
    await outgoing.put(
        pb.GenerateBatchRequest(abort=pb.AbortRequest(request_ids=["stop-me", "elsewhere"]))
    )
    await until_ended(call, answers, "stop-me", "keep")
    assert answers.last("stop-me").finish_reason == "abort"
    assert answers.last("keep").finish_reason == "length"
    assert len(answers.tokens("keep")) == 40
    assert "stop-me" in harness.engine.aborted_ids
    assert "elsewhere" not in harness.engine.aborted_ids
    await wait_until(lambda: harness.server.requests.in_flight == frozenset({"elsewhere"}))
    await outgoing.put(None)
    await read_all(call, answers)
    assert await call.code() == grpc.StatusCode.OK
    other.cancel()


async def test_leaving_the_stream_aborts_every_request_on_it(start_mock: StartServer) -> None:
    harness = await start_mock(step_delay=0.02)
    outgoing = Requests()
    call = harness.stub.GenerateBatch(outgoing.stream())
    ids = [f"left-{i}" for i in range(5)]
    for rid in ids:
        await outgoing.put(generate([10], rid, max_tokens=1000))
    answers = Answers()
    while len(answers.updates) < len(ids):
        answers.take(await call.read())
    assert harness.engine.load().running_requests == 5
    call.cancel()
    await wait_until(lambda: harness.engine.load().running_requests == 0, what="engine idle")
    assert set(ids) <= set(harness.engine.aborted_ids)
    await wait_until(lambda: not harness.server.requests.in_flight, what="table empty")


async def test_a_requests_timeout_aborts_it_alone(start_mock: StartServer) -> None:
    harness = await start_mock(step_delay=0.02)
    call = harness.stub.GenerateBatch(
        [
            generate([10], "late", timeout_ms=200, max_tokens=1000),
            generate([20], "on-time", timeout_ms=60_000, max_tokens=10),
        ]
    )
    answers = Answers()
    await read_all(call, answers)
    assert await call.code() == grpc.StatusCode.OK
    assert answers.errors["late"].code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
    assert "timeout_ms" in answers.errors["late"].message
    assert 0 < len(answers.tokens("late")) < 1000
    assert answers.tokens("on-time") == [21 + k for k in range(10)]
    assert "late" in harness.engine.aborted_ids
    assert harness.engine.load().running_requests == 0


async def test_unparsable_bytes_fail_that_message_only(mock: Harness) -> None:
    raw = mock.channel.stream_stream(
        "/vllm.engine.v1.VllmEngine/GenerateBatch",
        request_serializer=lambda b: b,
        response_deserializer=pb.GenerateBatchResponse.FromString,
    )
    good = generate([10], "fine", max_tokens=3).SerializeToString()
    call = raw([b"\xff\xff\xff", good])
    answers = Answers()
    await read_all(call, answers)  # type: ignore[arg-type]
    (refused,) = answers.refused
    assert refused.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "could not be parsed" in refused.message
    assert answers.tokens("fine") == [11, 12, 13]


async def test_draining_refuses_new_requests_per_request(start_mock: StartServer) -> None:
    harness = await start_mock(step_delay=0.02)
    outgoing = Requests()
    call = harness.stub.GenerateBatch(outgoing.stream())
    answers = Answers()
    await outgoing.put(generate([10], "before", max_tokens=20))
    answers.take(await call.read())
    harness.server.requests.start_draining()
    await outgoing.put(generate([10], "during", max_tokens=2))
    await outgoing.put(None)
    await read_all(call, answers)
    assert answers.refusal("during").code == grpc.StatusCode.UNAVAILABLE.value[0]
    assert "draining" in answers.refusal("during").message
    assert len(answers.tokens("before")) == 20  # in flight: it finishes


@pytest.mark.parametrize("compact", [False, True], ids=["stream-shape", "compact"])
async def test_a_stalled_stream_stalls_nothing_else_and_is_aborted(
    start_mock: StartServer, compact: bool
) -> None:
    config = ServerConfig(port=0, stream_stall_timeout_seconds=0.5, metrics_port=0)
    harness = await start_mock(config, tokens_per_step=2000, max_model_len=50_000_000)
    before = await scrape(harness.metrics_url)
    # A client that sends requests, reads once and then no more: long outputs fill
    # the transport's windows.
    stalled = harness.stub.GenerateBatch(
        [
            generate(
                [10],
                f"stalled-{i}",
                max_tokens=40_000_000,
                ignore_eos=True,
                skip_detokenize=compact,
                compact=compact,
            )
            for i in range(4)
        ]
    )
    await stalled.read()
    await wait_until(lambda: len(harness.server.requests.in_flight) == 4, what="admitted")
    # Another stream meanwhile runs to the end.
    answers = Answers()
    await read_all(
        harness.stub.GenerateBatch([generate([20], f"free-{i}", max_tokens=50) for i in range(3)]),
        answers,
    )
    assert all(len(answers.tokens(f"free-{i}")) == 50 for i in range(3))
    # The stall watchdog aborts the stalled stream's requests in the engine.
    await wait_until(lambda: not harness.server.requests.in_flight, timeout=30, what="aborted")
    assert harness.engine.load().running_requests == 0
    assert {f"stalled-{i}" for i in range(4)} <= set(harness.engine.aborted_ids)
    after = await scrape(harness.metrics_url)
    label = {"service": "vllm.engine.v1.VllmEngine", "method": "GenerateBatch:request"}
    assert delta(before, after, "vllm_servicer:requests_total", **label, code="OK") == 3
    assert delta(before, after, "vllm_servicer:requests_total", **label, code="CANCELLED") == 4
    stalled.cancel()


@pytest.mark.parametrize("compact", [True, False], ids=["compact", "stream-shape"])
async def test_decode_steps_handed_over_by_the_engine_keep_every_token_in_order(
    start_mock: StartServer, compact: bool
) -> None:
    harness = await start_mock(ServerConfig(port=0, metrics_port=0), step_delay=0.002)
    before = await scrape(harness.metrics_url)
    lengths = {f"r{i}": 20 + 7 * i for i in range(8)}
    answers = await run_batch(harness.stub, lengths, compact=compact)
    handed_over = 0
    for i, (rid, n) in enumerate(lengths.items()):
        assert answers.tokens(rid) == [100 * (i + 1) + 1 + k for k in range(n)], rid
        first, *middle, last = answers.updates[rid]
        assert first.HasField("metrics") and first.usage.prompt_tokens == 1
        assert (last.is_finished, last.finish_reason, last.usage.completion_tokens) == (
            True,
            "length",
            n,
        )
        assert last.HasField("metrics")
        handed_over += len(middle)
        if not compact:  # each message as GenerateStream's: cumulative usage, no metrics
            produced = len(first.token_ids)
            for update in middle:
                produced += len(update.token_ids)
                assert update.usage.completion_tokens == produced
                assert update.usage.prompt_tokens == 1 and not update.HasField("metrics")
    assert handed_over > 8 * 10  # most steps came straight from the engine's loop
    assert (answers.compact_runs > 0) == compact
    await wait_until(lambda: not harness.server.requests.in_flight)
    after = await scrape(harness.metrics_url)
    assert delta(before, after, "vllm_servicer:generated_tokens_total") == sum(lengths.values())


async def test_handed_off_steps_merge_until_taken_and_a_claim_keeps_their_order() -> None:
    from vllm_router.core.batching import Lane, Outbox
    from vllm_router.engine import EngineStep

    outbox: Outbox[str, str] = Outbox()
    lane, other = Lane("a", outbox, compact=True), Lane("b", outbox, compact=False)
    engine_list = [1, 2]
    lane(engine_list, 2)
    other([9], 1)
    lane([3], 3)  # steps while no message is taken merge into one run
    assert lane.completion_tokens == 3  # as the engine told it
    assert engine_list == [1, 2]  # the engine's own list is never extended
    taken = outbox.take()
    assert taken is not None
    message, _sent = taken
    assert [x.request_id for x in message.lanes] == ["a", "b"]
    assert message.lane_tokens == [[1, 2, 3], [9]] and message.token_count == 4
    assert outbox.take() is None
    # The request's task takes a step (its last) while its lane holds tokens: the lane's
    # come first, and leave the next message.
    lane([4, 5], 5)
    last = EngineStep(token_ids=[6], text="", finished=True, prompt_tokens=1, completion_tokens=6)
    claimed = lane.claim(last)
    assert claimed.token_ids == [4, 5, 6] and claimed.finished
    assert outbox.take() is None
    assert (lane.prompt_tokens, lane.completion_tokens) == (1, 6)


async def test_a_request_names_its_own_trace_context(mock: Harness) -> None:
    own = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    stream_trace = "00-11111111111111111111111111111111-2222222222222222-01"
    call = mock.stub.GenerateBatch(
        [
            generate([10], "own", max_tokens=2, traceparent=own),
            generate([10], "bad", max_tokens=2, traceparent="00-xyz"),
        ],
        metadata=(("traceparent", stream_trace),),
    )
    answers = Answers()
    await read_all(call, answers)
    assert answers.tokens("own") == [11, 12]
    refusal = answers.refusal("bad")
    assert refusal.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "traceparent" in refusal.message
    assert mock.engine.last_request is not None
    assert mock.engine.last_request.trace_headers == {"traceparent": own}
    call = mock.stub.GenerateBatch(
        [generate([10], "inherits", max_tokens=1)], metadata=(("traceparent", stream_trace),)
    )
    await read_all(call, Answers())
    assert mock.engine.last_request.trace_headers == {"traceparent": stream_trace}


async def test_each_of_n_samples_finishes_on_its_own_index(mock: Harness) -> None:
    n = 2
    call = mock.stub.GenerateBatch([generate([10], "multi", max_tokens=3, n=n)])
    answers = Answers()
    await read_all(call, answers)
    finished = [u.index for u in answers.updates["multi"] if u.is_finished]
    assert sorted(finished) == list(range(n))


async def test_the_client_runs_many_requests_on_one_batch_stream(start_mock: StartServer) -> None:
    from vllm_router.client import InvalidRequestError, WorkerClient

    harness = await start_mock(step_delay=0.01)
    async with WorkerClient(harness.address) as worker, worker.batch() as batch:

        async def tokens(first: int, count: int) -> list[int]:
            stream = batch.stream([first], max_tokens=count, skip_detokenize=True)
            got: list[int] = []
            async for message in stream:  # compact runs read back as GenerateStream's
                got += message.token_ids
                assert message.usage.completion_tokens == len(got)
                assert message.usage.prompt_tokens == 1
            return got

        got = await asyncio.gather(*(tokens(100 * i, 5 + i) for i in range(1, 9)))
        assert got == [[100 * i + 1 + k for k in range(5 + i)] for i in range(1, 9)]

        # A request's error is raised by its own iterator, typed as GenerateStream's.
        with pytest.raises(InvalidRequestError, match="temperature"):
            await tokens_with(batch, temperature=-1.0)

        # Leaving early aborts that request in the engine; the stream serves on.
        async for message in batch.stream([10], request_id="early", max_tokens=1000):
            assert message.token_ids
            break
        await wait_until(lambda: "early" in harness.engine.aborted_ids, what="aborted")
        assert await tokens(7, 3) == [8, 9, 10]
    await wait_until(lambda: not harness.server.requests.in_flight)


async def tokens_with(batch, **sampling: object) -> list[int]:  # type: ignore[no-untyped-def]
    return [t async for m in batch.stream([10], max_tokens=2, **sampling) for t in m.token_ids]


async def test_a_batch_stream_needs_the_api_key_as_every_rpc(start_mock: StartServer) -> None:
    harness = await start_mock(ServerConfig(port=0, api_key="sesame"))
    call = harness.stub.GenerateBatch([generate([10], "nokey", max_tokens=2)])
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await read_all(call, Answers())
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    keyed = harness.stub.GenerateBatch(
        [generate([10], "key", max_tokens=2)], metadata=(("authorization", "Bearer sesame"),)
    )
    answers = Answers()
    await read_all(keyed, answers)
    assert answers.tokens("key") == [11, 12]
