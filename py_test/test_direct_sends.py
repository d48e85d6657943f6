"""Direct sends on --transport native (core/flight.py): a stream's plain decode steps go from
the engine's output loop into the transport without the request's task, for every contract,
and a client sees exactly what it sees without them: the same messages, usage, finish and
metrics; a full client window hands the step back to the task, in order, nothing lost."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import grpc
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc
from test_transport import STALLED_CLIENT, _require

from vllm_router.proto import vllm_engine_pb2_grpc as pb_grpc
from vllm_router.proto import vllm_native_pb2 as npb
from vllm_router.proto import vllm_native_pb2_grpc as npb_grpc
from vllm_router.server import ServerConfig

from harness import (
    DirectCount,
    Harness,
    StartServer,
    delta,
    read_rest,
    request,
    scrape,
    wait_until,
    without_load,
)

pytestmark = pytest.mark.usefixtures("native_installed")


@pytest.fixture
def native_installed() -> None:
    _require("native")


def _ours(token_ids: list[int], max_tokens: int, request_id: str = "", **fields: Any) -> Any:
    req = request(token_ids, request_id, max_tokens=max_tokens, ignore_eos=True, **fields)
    req.skip_detokenize = True
    return req


def _vllm_grpc(token_ids: list[int], max_tokens: int) -> vpb.GenerateRequest:
    return vpb.GenerateRequest(
        request_id="vllm-grpc",
        tokenized=vpb.TokenizedInput(input_ids=token_ids),
        sampling_params=vpb.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        stream=True,
    )


def _native(token_ids: list[int], max_tokens: int) -> npb.GenerateRequest:
    req = npb.GenerateRequest(
        request_id="native",
        stopping=npb.StoppingCriteria(max_new_tokens=max_tokens, ignore_eos=True),
        response=npb.ResponseOptions(output_token_ids=True, output_text=False),
    )
    req.token_ids.ids.extend(token_ids)
    return req


async def _streams(harness: Harness) -> dict[str, list[Any]]:
    """One stream of each contract (all plain token-only requests), message by message."""
    channel = harness.channel
    calls = {
        "vllm.engine.v1 GenerateStream": pb_grpc.VllmEngineStub(channel).GenerateStream(
            _ours([10], 40, request_id="ours")
        ),
        "vllm.grpc.engine Generate": vpb_grpc.VllmEngineStub(channel).Generate(
            _vllm_grpc([20], 40)
        ),
        "vllm.Inference GenerateStream": npb_grpc.InferenceStub(channel).GenerateStream(
            _native([30], 40)
        ),
    }
    streams: dict[str, list[Any]] = {}
    for name, call in calls.items():
        streams[name] = [without_load(m) async for m in call]  # type: ignore[attr-defined]
    return streams


async def _all_ended(harness: Harness) -> None:
    await wait_until(lambda: not harness.server.requests.in_flight, what="the table empty")


async def test_every_contracts_stream_is_the_same_with_direct_sends(
    start_mock: StartServer, direct_count: DirectCount, figures
) -> None:
    """Message for message, the same on grpcio, on native sending from the handler, and on
    native with direct sends, which sent the decode steps (all but each stream's first
    and last); the token and finish counters moved alike."""
    seen: dict[str, dict[str, list[Any]]] = {}
    sent: dict[str, int] = {}
    counted: dict[str, list[float]] = {}
    for name, config in {
        "grpcio": ServerConfig(port=0, transport="grpcio", metrics_port=0),
        "native, from the handler": ServerConfig(
            port=0, transport="native", direct_sends=False, metrics_port=0
        ),
        "native, direct": ServerConfig(port=0, transport="native", metrics_port=0),
    }.items():
        # A step every 2 ms: the client keeps up, so no transport merges steps.
        harness = await start_mock(config, step_delay=0.002)
        before, count_before = await scrape(harness.metrics_url), direct_count.sent
        seen[name] = await _streams(harness)
        await _all_ended(harness)  # every RPC has ended and been counted
        after = await scrape(harness.metrics_url)
        sent[name] = direct_count.sent - count_before
        counted[name] = [
            delta(before, after, "vllm_servicer:generated_tokens_total"),
            delta(before, after, "vllm_servicer:finish_reason_total", reason="length"),
            delta(before, after, "vllm_servicer:time_between_messages_seconds_count"),
        ]
    reference = seen["grpcio"]
    tokens = [t for m in reference["vllm.engine.v1 GenerateStream"] for t in m.token_ids]
    assert tokens == [11 + k for k in range(40)]
    assert reference["vllm.engine.v1 GenerateStream"][-1].usage.completion_tokens == 40
    for name, streams in seen.items():
        assert streams == reference, name
    # 120 tokens, 3 finishes, and a gap before every message but each stream's first (the
    # vllm.grpc.engine stream ends in two messages, the native one starts with two).
    assert all(c == [3 * 40, 3, 39 + 40 + 40] for c in counted.values()), counted
    # Each stream's first and last step go through its task; every decode step between
    # them went straight from the engine's loop (the mock offers each of its 38).
    assert sent == {"grpcio": 0, "native, from the handler": 0, "native, direct": 3 * 38}
    assert direct_count.refused == 0
    figures(f"3 contracts x 40 tokens: identical on grpcio, native and native direct; {sent}")


async def test_a_request_that_is_not_plain_is_never_sent_directly(
    start_mock: StartServer, direct_count: DirectCount
) -> None:
    harness = await start_mock(ServerConfig(port=0, transport="native"), step_delay=0.001)
    for fields in ({"logprobs": 1}, {"n": 2, "temperature": 0.5}, {"stream_interval": 3}):
        messages = [m async for m in harness.stub.GenerateStream(_ours([10], 12, **fields))]
        assert messages[-1].is_finished, fields
    text = request([10], max_tokens=12)  # detokenized: a text delta per step
    messages = [m async for m in harness.stub.GenerateStream(text)]
    assert "".join(m.text_delta for m in messages) and messages[-1].usage.completion_tokens == 12
    assert (direct_count.sent, direct_count.refused) == (0, 0)


async def test_a_cancelled_direct_stream_leaves_the_engine_idle(
    start_mock: StartServer, direct_count: DirectCount
) -> None:
    harness = await start_mock(ServerConfig(port=0, transport="native"), step_delay=0.002)
    call = harness.stub.GenerateStream(_ours([10], 4000, request_id="leaving"))
    for _ in range(20):
        await call.read()
    call.cancel()
    await wait_until(lambda: "leaving" in harness.engine.aborted_ids, what="the engine aborted it")
    await wait_until(lambda: not harness.server.requests.in_flight, what="the table empty")
    assert harness.engine.load().running_requests == 0
    assert direct_count.sent > 0  # it was being sent directly when the client left
    deadline = harness.stub.GenerateStream(_ours([10], 4000, request_id="late"), timeout=0.3)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in deadline:
            pass
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await wait_until(lambda: "late" in harness.engine.aborted_ids, what="the deadline aborted it")


async def test_a_full_client_window_hands_steps_back_in_order(
    start_mock: StartServer, direct_count: DirectCount, figures
) -> None:
    """A client that stops reading a long stream: its window and the transport's buffer fill
    (h2's 400 KiB a stream), direct sends are refused and the task sends those steps, then
    direct sends resume; when it reads again every token is there, in order, the usage
    counting each once."""
    harness = await start_mock(ServerConfig(port=0, transport="native"), max_model_len=100_000)
    async with grpc.aio.insecure_channel(harness.address, options=STALLED_CLIENT) as channel:
        call = pb_grpc.VllmEngineStub(channel).GenerateStream(_ours([10], 40_000))
        messages = [await call.read()]
        # The engine writes far more than a window meanwhile; how soon it fills is the
        # machine's speed, so wait for the transport to refuse, not for a fixed time.
        await wait_until(lambda: direct_count.refused_once_sending > 0, 60.0, "a full window")
        await asyncio.sleep(0.5)  # refused steps pile up in the task's buffer meanwhile
        sent_while_stalled = direct_count.sent
        messages += await read_rest(call)
    tokens = [t for m in messages for t in m.token_ids]
    assert tokens == [(11 + k) % 32_000 for k in range(40_000)]  # the mock wraps its vocabulary
    usage = [m.usage.completion_tokens for m in messages]
    assert usage == list(itertools.accumulate(len(m.token_ids) for m in messages))
    assert messages[-1].is_finished and messages[-1].finish_reason == "length"
    # Once the client read again, the engine's loop sent steps directly again. How many
    # steps went which way is the machine's speed: reported, not asserted.
    resumed = direct_count.sent - sent_while_stalled
    assert resumed > 0, vars(direct_count)
    figures(
        f"40,000 tokens past a full window: {direct_count.refused_once_sending:,} steps refused "
        f"by the transport and sent by the task, {direct_count.sent:,} direct ({resumed:,} "
        "once the client read again); every token in order"
    )
