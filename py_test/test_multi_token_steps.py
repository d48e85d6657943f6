"""Engine steps that carry several tokens (the mock's `tokens_per_step`; speculative decoding
on a real engine: test_real_multi_token.py), given direct to a stream's direct send or a
batched stream's lane: every contract streams exactly the tokens the engine made, a message
per step, each counted once and at its full size (usage, the final counts, the servicer's
token counter); and the servicer's gaps between a direct stream's messages add up to the
time the stream took."""

from __future__ import annotations

import itertools
import time
from typing import Any

import pytest
from batches import run_batch
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc
from test_direct_sends import _all_ended
from test_transport import _require

from vllm_router.proto import vllm_engine_pb2_grpc as pb_grpc
from vllm_router.proto import vllm_native_pb2 as npb
from vllm_router.proto import vllm_native_pb2_grpc as npb_grpc
from vllm_router.server import ServerConfig

from harness import (
    DirectCount,
    Harness,
    StartServer,
    delta,
    request,
    scrape,
    without_load,
)

# Three tokens a step, 40 tokens a request: 13 steps of three, then one of one (the length
# limit ends the 14th step at its first token). The first and the last step go through the
# request's task; the 12 between them go direct (engine/direct.py).
PER_STEP = 3
MAX_TOKENS = 40
SIZES = [PER_STEP] * 13 + [1]
HANDED_OFF = len(SIZES) - 2
# Prompt [p] streams p + 1, p + 2, ... (the mock's rule).
PROMPTS = {"v1": 10, "vllm.grpc.engine": 100, "native": 1000}


def _expected(prompt: int) -> list[int]:
    return [prompt + 1 + k for k in range(MAX_TOKENS)]


def _chunks(prompt: int) -> list[list[int]]:
    """The expected tokens cut into the engine's steps."""
    tokens, cuts = _expected(prompt), [0, *itertools.accumulate(SIZES)]
    return [tokens[a:b] for a, b in itertools.pairwise(cuts)]


async def _stream_each_contract(harness: Harness) -> dict[str, list[Any]]:
    """One token-only stream of each contract, message by message (one after the other)."""
    channel = harness.channel
    ours = request([PROMPTS["v1"]], "v1", max_tokens=MAX_TOKENS, ignore_eos=True)
    ours.skip_detokenize = True
    theirs = vpb.GenerateRequest(
        request_id="vllm-grpc",
        tokenized=vpb.TokenizedInput(input_ids=[PROMPTS["vllm.grpc.engine"]]),
        sampling_params=vpb.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
        stream=True,
    )
    native = npb.GenerateRequest(
        request_id="native",
        stopping=npb.StoppingCriteria(max_new_tokens=MAX_TOKENS, ignore_eos=True),
        response=npb.ResponseOptions(output_token_ids=True, output_text=False),
    )
    native.token_ids.ids.append(PROMPTS["native"])
    calls = {
        "v1": pb_grpc.VllmEngineStub(channel).GenerateStream(ours),
        "vllm.grpc.engine": vpb_grpc.VllmEngineStub(channel).Generate(theirs),
        "native": npb_grpc.InferenceStub(channel).GenerateStream(native),
    }
    streams: dict[str, list[Any]] = {}
    for name, call in calls.items():
        streams[name] = [without_load(m) async for m in call]  # type: ignore[attr-defined]
    return streams


def _check_v1(messages: list[Any]) -> None:
    """vllm.engine.v1 GenerateStream: a message per step, usage counting every token so far."""
    assert [list(m.token_ids) for m in messages] == _chunks(PROMPTS["v1"])
    assert [m.usage.completion_tokens for m in messages] == list(itertools.accumulate(SIZES))
    assert {m.usage.prompt_tokens for m in messages} == {1}
    assert [m.is_finished for m in messages] == [False] * (len(SIZES) - 1) + [True]
    assert messages[-1].finish_reason == "length"


def _check_vllm_grpc(messages: list[Any]) -> None:
    """vllm.grpc.engine Generate: a chunk per step counting its own tokens (the router sums
    them), then the complete, with the last step's tokens again (as vLLM's --grpc server)."""
    *chunks, complete = messages
    assert [list(m.chunk.token_ids) for m in chunks] == _chunks(PROMPTS["vllm.grpc.engine"])
    assert [m.chunk.completion_tokens for m in chunks] == SIZES
    assert sum(m.chunk.completion_tokens for m in chunks) == MAX_TOKENS
    assert complete.WhichOneof("response") == "complete"
    assert list(complete.complete.output_ids) == [PROMPTS["vllm.grpc.engine"] + MAX_TOKENS]
    assert (complete.complete.finish_reason, complete.complete.completion_tokens) == ("length", 1)


def _check_native(messages: list[Any]) -> None:
    """vllm.Inference GenerateStream: the prompt's facts, then a message per step; the finish
    counts the sequence's tokens in all."""
    first, *outputs = messages
    assert first.prompt_info.num_prompt_tokens == 1
    assert [list(m.outputs.token_ids) for m in outputs] == _chunks(PROMPTS["native"])
    assert [m.outputs.num_tokens for m in outputs] == SIZES
    assert [m.outputs.HasField("finish_info") for m in outputs] == [False] * 13 + [True]
    finish = outputs[-1].outputs.finish_info
    assert (finish.num_output_tokens, finish.finish_reason) == (MAX_TOKENS, npb.LENGTH)


async def test_multi_token_steps_stream_exactly_through_every_contract_with_direct_sends(
    start_mock: StartServer, direct_count: DirectCount
) -> None:
    """Three tokens a step, on --transport native with direct sends (the 12 decode steps
    between each stream's first and last go from the engine's loop to the transport) and
    without (--no-direct-sends: every step through the request's task): each contract's
    messages are exactly the engine's steps, their counts are full step sizes, and both say
    the same. The servicer's token counter counts each handed-off step at its size."""
    _require("native")
    seen: dict[str, dict[str, list[Any]]] = {}
    counted: dict[str, tuple[float, float]] = {}
    offered: dict[str, tuple[int, int]] = {}  # steps the engine offered: (sent, refused)
    for name, config in {
        "native, direct": ServerConfig(port=0, transport="native", metrics_port=0),
        "native, from the handler": ServerConfig(
            port=0, transport="native", direct_sends=False, metrics_port=0
        ),
    }.items():
        # A step every 2 ms: the client keeps up, so steps are seldom refused (the mock then
        # yields the refused step as it is: the same message, sent by the task).
        harness = await start_mock(config, tokens_per_step=PER_STEP, step_delay=0.002)
        before = await scrape(harness.metrics_url)
        count_before = (direct_count.sent, direct_count.refused)
        seen[name] = await _stream_each_contract(harness)
        await _all_ended(harness)  # every RPC has ended and been counted
        after = await scrape(harness.metrics_url)
        offered[name] = (
            direct_count.sent - count_before[0],
            direct_count.refused - count_before[1],
        )
        counted[name] = (
            delta(before, after, "vllm_servicer:generated_tokens_total"),
            delta(before, after, "vllm_servicer:finish_reason_total", reason="length"),
        )
    streams = seen["native, direct"]
    _check_v1(streams["v1"])
    _check_vllm_grpc(streams["vllm.grpc.engine"])
    _check_native(streams["native"])
    assert seen["native, from the handler"] == streams
    # Each stream's 12 decode steps between its first and last were offered to its direct
    # send, and sent (but for any a busy machine's transport could not take at once).
    (sent, refused), nothing = offered["native, direct"], offered["native, from the handler"]
    assert sent + refused == 3 * HANDED_OFF and sent > 0, offered
    assert nothing == (0, 0)
    assert set(counted.values()) == {(3 * MAX_TOKENS, 3)}, counted


@pytest.mark.parametrize("compact", [False, True], ids=["stream-shape", "compact"])
async def test_multi_token_steps_handed_to_batched_streams_lanes_count_every_token(
    start_mock: StartServer, compact: bool
) -> None:
    """GenerateBatch: the engine hands multi-token steps off to each request's lane; every
    token arrives once, in order, each update's usage (stream-shape lanes) counts every token
    so far, the last one all of them, and so does the servicer's token counter."""
    harness = await start_mock(
        ServerConfig(port=0, metrics_port=0), tokens_per_step=PER_STEP, step_delay=0.002
    )
    before = await scrape(harness.metrics_url)
    lengths = {f"r{i}": 20 + 7 * i for i in range(6)}
    answers = await run_batch(harness.stub, lengths, compact=compact)
    handed_over = 0
    for i, (rid, n) in enumerate(lengths.items()):
        assert answers.tokens(rid) == [100 * (i + 1) + 1 + k for k in range(n)], rid
        first, *middle, last = answers.updates[rid]
        assert list(first.token_ids) == answers.tokens(rid)[:PER_STEP]
        assert first.usage.completion_tokens == PER_STEP
        assert (last.is_finished, last.finish_reason, last.usage.completion_tokens) == (
            True,
            "length",
            n,
        )
        handed_over += len(middle)
        if not compact:  # as GenerateStream's messages: usage counts every token so far
            produced = PER_STEP
            for update in middle:
                produced += len(update.token_ids)
                assert update.usage.completion_tokens == produced, rid
    assert handed_over > 0
    await _all_ended(harness)
    after = await scrape(harness.metrics_url)
    assert delta(before, after, "vllm_servicer:generated_tokens_total") == sum(lengths.values())


async def test_the_gaps_between_a_direct_streams_messages_add_up_to_the_stream(
    start_mock: StartServer, direct_count: DirectCount
) -> None:
    """vllm_servicer:time_between_messages_seconds observes, for every message but a stream's
    first, the time since the stream's previous message, however it was sent (the task's
    send, or a direct send from the engine's loop): over one stream the gaps add up to the
    time between its first and last message, at least the engine's steps' delays and never
    more than the client waited for the whole stream."""
    _require("native")
    delay, steps = 0.005, 40
    config = ServerConfig(port=0, transport="native", metrics_port=0)
    harness = await start_mock(config, tokens_per_step=PER_STEP, step_delay=delay)
    before = await scrape(harness.metrics_url)
    count_before = (direct_count.sent, direct_count.refused)
    req = request([10], "gaps", max_tokens=PER_STEP * steps, ignore_eos=True)
    req.skip_detokenize = True
    started = time.monotonic()
    messages = [m async for m in harness.stub.GenerateStream(req)]
    waited = time.monotonic() - started
    await _all_ended(harness)
    after = await scrape(harness.metrics_url)
    assert [len(m.token_ids) for m in messages] == [PER_STEP] * steps
    assert messages[-1].usage.completion_tokens == PER_STEP * steps
    # Every step but the first and the last was offered to the direct send, and sent (but
    # for any a busy machine's transport could not take at once: the task sent those).
    sent, refused = direct_count.sent - count_before[0], direct_count.refused - count_before[1]
    assert sent + refused == steps - 2 and sent > 0, (sent, refused)
    name = "vllm_servicer:time_between_messages_seconds"
    assert delta(before, after, f"{name}_count") == steps - 1
    gaps = delta(before, after, f"{name}_sum")
    # The mock makes each step `delay` after its consumer took the one before.
    assert (steps - 1) * delay <= gaps <= waited, (gaps, waited)
    assert delta(before, after, "vllm_servicer:time_to_first_message_seconds_count") == 1
