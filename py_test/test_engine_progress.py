"""The engine progress watchdog on the mock: a stall takes the worker out of rotation and back
when the engine steps again, a stall past the second limit is engine death, a slow or idle or
paused engine is never judged; and health watches that end with OK when the server stops."""

from __future__ import annotations

import asyncio
import importlib.util
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc

from vllm_router.core.progress import StallLimits, StallStage, silent_for
from vllm_router.proto import vllm_native_pb2 as npb
from vllm_router.proto import vllm_native_pb2_grpc as npb_grpc
from vllm_router.server import ServerConfig
from vllm_router.server.app import preflight
from vllm_router.server.config import StartupError
from vllm_router.server.health_service import LIVENESS
from vllm_router.server.registry import CONTRACTS

from harness import Harness, StartServer, read_rest, request, require, scrape, wait_until

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# The watchdog's limits in these tests (seconds without a step): out of rotation, then failed.
TIMEOUT = 1.0
EXIT = 3.0
STALL = 2.0  # a stall between the two


def _config(**more: object) -> ServerConfig:
    return ServerConfig(
        port=0,
        shutdown_grace_seconds=1.0,
        engine_stall_timeout_seconds=TIMEOUT,
        engine_stall_exit_seconds=EXIT,
        **more,  # type: ignore[arg-type]
    )


def _native(ids: list[int], max_new: int) -> npb.GenerateRequest:
    req = npb.GenerateRequest(stopping=npb.StoppingCriteria(max_new_tokens=max_new))
    req.token_ids.ids.extend(ids)
    return req


async def _health(harness: Harness) -> set[int]:
    """What grpc.health.v1 says for the server and every contract."""
    health = health_pb2_grpc.HealthStub(harness.channel)
    heard = set()
    for service in ("", *(entry.service_name for entry in CONTRACTS)):
        heard.add((await health.Check(health_pb2.HealthCheckRequest(service=service))).status)
    return heard


async def _refused(harness: Harness) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await harness.stub.Generate(request([10], max_tokens=1))
    return err.value.code(), err.value.details() or ""


def _stage(harness: Harness) -> StallStage:
    return harness.server.watchdog.stage


async def _stalls(harness: Harness) -> dict[str, float]:
    samples = await scrape(harness.metrics_url)
    counted = {
        stage: samples.get(("vllm_servicer:engine_stalls_total", (("stage", stage),)), -1.0)
        for stage in ("out_of_rotation", "recovered", "failed")
    }
    counted["gauge"] = samples[("vllm_servicer:engine_stall_stage", ())]
    return counted


async def test_a_stall_that_recovers_takes_the_worker_out_of_rotation_and_back(
    start_mock: StartServer,
) -> None:
    """Between the two limits: NOT_SERVING everywhere and new requests refused, the streams in
    flight kept; at the next step SERVING again, every stream whole, the worker alive."""
    harness = await start_mock(
        _config(metrics_port=0), step_delay=0.005, stall_after_tokens=30, stall_seconds=STALL
    )
    ours = harness.stub.GenerateStream(request([10], max_tokens=60))
    native_request = _native([10], 60)
    native_request.response.output_token_ids = True
    native = npb_grpc.InferenceStub(harness.channel).GenerateStream(native_request)
    unary = harness.stub.Generate(request([12], max_tokens=60))
    await ours.read()
    await native.read()
    await wait_until(lambda: _stage(harness) is StallStage.OUT_OF_ROTATION, timeout=STALL)
    assert await _health(harness) == {NOT_SERVING}
    liveness = health_pb2.HealthCheckRequest(service=LIVENESS)  # the process still serves
    assert (await health_pb2_grpc.HealthStub(harness.channel).Check(liveness)).status == SERVING
    code, details = await _refused(harness)
    assert code == grpc.StatusCode.UNAVAILABLE and "out of rotation" in details, details
    assert (await _stalls(harness))["gauge"] == 1
    assert len(harness.server.requests.in_flight) == 3  # kept waiting, none failed

    rest = await asyncio.wait_for(read_rest(ours), 10)
    assert sum(len(m.token_ids) for m in rest) == 59 and rest[-1].finish_reason == "length"
    rest = await asyncio.wait_for(read_rest(native), 10)
    assert sum(len(m.outputs.token_ids) for m in rest) == 60  # the first message had none
    assert rest[-1].outputs.finish_info.finish_reason == npb.LENGTH
    assert len((await unary).output_token_ids) == 60
    await wait_until(lambda: _stage(harness) is StallStage.PROGRESSING, timeout=2)
    assert await _health(harness) == {SERVING}
    assert len((await harness.stub.Generate(request([10], max_tokens=3))).output_token_ids) == 3
    assert await _stalls(harness) == {
        "out_of_rotation": 1, "recovered": 1, "failed": 0, "gauge": 0
    }  # fmt: skip
    assert harness.server.exit_code == 0 and not harness.server.state.engine_dead


async def test_a_stuck_engine_fails_every_request_and_the_worker(start_mock: StartServer) -> None:
    """Out of rotation at the first limit, streams kept; at the second every request fails
    UNAVAILABLE saying why and the server exits non-zero."""
    harness = await start_mock(_config(metrics_port=0), step_delay=0.005, stall_after_tokens=30)
    ours = harness.stub.GenerateStream(request([10], max_tokens=1000))
    native = npb_grpc.InferenceStub(harness.channel).GenerateStream(_native([10], 1000))
    unary = harness.stub.Generate(request([12], max_tokens=1000))
    await ours.read()
    await native.read()
    started = time.monotonic()
    await wait_until(lambda: _stage(harness) is StallStage.OUT_OF_ROTATION, timeout=EXIT)
    assert await _health(harness) == {NOT_SERVING}
    assert len(harness.server.requests.in_flight) == 3
    failures = []
    for call in (ours, native, unary):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await asyncio.wait_for(read_rest(call) if call is not unary else call, 10)
        failures.append((err.value.code(), err.value.details()))
    waited = time.monotonic() - started
    # Every request hears why, past the second limit and within a poll of it (the stall
    # began after ~10 tokens each; a hang would have run into wait_for's 10 s).
    assert EXIT - TIMEOUT < waited < EXIT + 2.0, waited
    for code, details in failures:
        assert code == grpc.StatusCode.UNAVAILABLE
        assert "stopped making progress" in details
    assert await _health(harness) == {NOT_SERVING}
    code, details = await _refused(harness)
    assert code == grpc.StatusCode.UNAVAILABLE and "stopped making progress" in details
    assert not harness.server.requests.in_flight
    assert (await _stalls(harness))["failed"] == 1
    assert harness.server.exit_code == 1  # the process exits non-zero: its supervisor restarts it


@pytest.mark.parametrize("transport", ["grpcio", "native"])
async def test_a_stream_says_nothing_before_the_engines_first_step(
    start_mock: StartServer, transport: str
) -> None:
    """A stream the engine has not answered yet has sent nothing, on every contract: when the
    worker then fails, a router retries it on another worker (it cannot retry a stream that
    has begun: vllm-router passed a hung worker's error on to clients whose native stream
    had received only prompt_info). Once the engine steps again, each stream is whole."""
    if transport == "native":
        require(
            importlib.util.find_spec("pygrpc_native") is not None,
            "pygrpc-native is not installed (make test installs it)",
        )
    harness = await start_mock(
        _config(transport=transport), step_delay=0.005, stall_after_tokens=10, stall_seconds=STALL
    )
    first = harness.stub.GenerateStream(request([10], max_tokens=30))
    await first.read()
    await wait_until(lambda: harness.engine._stalled_until is not None, timeout=2)
    native_request = _native([10, 11, 12], 5)
    native_request.response.output_token_ids = True
    smg_request = vpb.GenerateRequest(
        tokenized=vpb.TokenizedInput(input_ids=[10, 11]),
        sampling_params=vpb.SamplingParams(max_tokens=5),
        stream=True,
    )
    calls = {
        "vllm.Inference": npb_grpc.InferenceStub(harness.channel).GenerateStream(native_request),
        "vllm.engine.v1": harness.stub.GenerateStream(request([10], max_tokens=5)),
        "vllm.grpc.engine": vpb_grpc.VllmEngineStub(harness.channel).Generate(smg_request),
    }
    heard: dict[str, list] = {name: [] for name in calls}

    async def listen(name: str) -> None:
        async for message in calls[name]:
            heard[name].append(message)

    listeners = [asyncio.create_task(listen(name)) for name in calls]
    await wait_until(lambda: len(harness.server.requests.in_flight) == 4, timeout=2)
    await asyncio.sleep(TIMEOUT / 2)  # the engine still stalled, under the first limit
    assert harness.engine._stalled_until is not None
    assert heard == {name: [] for name in calls}
    await asyncio.wait_for(asyncio.gather(*listeners), STALL + 5)
    native = heard["vllm.Inference"]
    assert native[0].prompt_info.num_prompt_tokens == 3 and not native[0].HasField("outputs")
    assert [len(m.outputs.token_ids) for m in native[1:]] == [1] * 5
    assert sum(len(m.token_ids) for m in heard["vllm.engine.v1"]) == 5
    assert heard["vllm.grpc.engine"][-1].HasField("complete")
    assert sum(len(m.chunk.token_ids) for m in heard["vllm.grpc.engine"]) == 5


@pytest.mark.parametrize("recovers", [True, False], ids=["recovers", "stays-stuck"])
async def test_a_stalled_engine_whose_streams_all_left_is_asked(
    start_mock: StartServer, recovers: bool
) -> None:
    """Out of rotation, then every client leaves: no step will come to say the engine runs
    again, so it is asked (one question, `is_paused`): answered, SERVING again; unanswered
    past the second limit, failed as stuck (nothing left in flight to fail)."""
    seconds = STALL if recovers else 0
    harness = await start_mock(
        _config(), step_delay=0.005, stall_after_tokens=20, stall_seconds=seconds
    )
    stream = harness.stub.GenerateStream(request([10], max_tokens=1000))
    await stream.read()
    await wait_until(lambda: _stage(harness) is StallStage.OUT_OF_ROTATION, timeout=EXIT)
    stream.cancel()
    await wait_until(lambda: not harness.server.requests.in_flight, timeout=2)
    if recovers:
        await wait_until(lambda: _stage(harness) is StallStage.PROGRESSING, timeout=EXIT)
        assert await _health(harness) == {SERVING}
        assert harness.server.exit_code == 0
    else:
        await wait_until(lambda: _stage(harness) is StallStage.FAILED, timeout=EXIT + 2)
        assert harness.server.exit_code == 1


async def test_a_slow_step_that_recovers_is_only_slow(start_mock: StartServer) -> None:
    """A step slower than usual but under the first limit: the worker never leaves rotation
    (not left and come back: the stalls counter says it never left)."""
    harness = await start_mock(
        _config(metrics_port=0), step_delay=0.002, stall_after_tokens=5, stall_seconds=TIMEOUT / 2
    )
    messages = await read_rest(harness.stub.GenerateStream(request([10], max_tokens=40)))
    assert sum(len(m.token_ids) for m in messages) == 40
    assert messages[-1].finish_reason == "length"
    assert harness.server.exit_code == 0
    assert not harness.server.state.engine_dead
    assert _stage(harness) is StallStage.PROGRESSING
    assert await _stalls(harness) == {
        "out_of_rotation": 0, "recovered": 0, "failed": 0, "gauge": 0
    }  # fmt: skip


async def test_idle_paused_or_unread_is_no_stall(start_mock: StartServer) -> None:
    harness = await start_mock(_config(), step_delay=0.002)
    await asyncio.sleep(TIMEOUT * 1.5)  # idle: nothing owed
    # Paused on purpose with a request held (vLLM's keep mode) past both limits: held, not
    # stuck; it never leaves rotation.
    control = npb_grpc.ControlStub(harness.channel)
    held = harness.stub.GenerateStream(request([10], max_tokens=20))
    await held.read()
    await control.PauseGeneration(npb.PauseGenerationRequest(mode=npb.PAUSE_MODE_KEEP))
    await asyncio.sleep(EXIT + 1.0)
    assert silent_for(harness.engine) == 0.0
    assert _stage(harness) is StallStage.PROGRESSING and await _health(harness) == {SERVING}
    await control.ResumeGeneration(npb.ResumeGenerationRequest())
    assert sum(len(m.token_ids) for m in await read_rest(held)) == 19
    # A client that reads nothing, past both limits: its step waits for the client, the
    # engine owes nothing; the worker stays in rotation and its stream is not failed.
    unread = harness.stub.GenerateStream(request([10], max_tokens=4000))
    await unread.read()
    await asyncio.sleep(EXIT + 1.0)
    assert _stage(harness) is StallStage.PROGRESSING and await _health(harness) == {SERVING}
    # Owed nothing (grpcio: the step waits for the client) or stepping (native: its sends
    # are buffered): never a silence that nears a limit.
    assert silent_for(harness.engine) < TIMEOUT / 2
    assert len(harness.server.requests.in_flight) == 1  # still open, not failed
    unread.cancel()
    assert harness.server.exit_code == 0
    assert not harness.server.state.engine_dead


def test_the_exit_limit_must_be_past_the_first() -> None:
    cases = [(120, 600, False), (120, 0, False), (0, 5, False), (120, 120, True),
             (120, 60, True), (-1, 600, True)]  # fmt: skip
    for timeout, exit_after, wrong in cases:
        problem = StallLimits(timeout, exit_after).check()
        assert (problem is not None) == wrong, (timeout, exit_after, problem)
    with pytest.raises(StartupError, match="must be longer than"):
        preflight(ServerConfig(engine_stall_timeout_seconds=30, engine_stall_exit_seconds=30))


async def test_health_watches_end_with_ok_after_not_serving(start_mock: StartServer) -> None:
    harness = await start_mock(ServerConfig(port=0, shutdown_grace_seconds=1.0))
    health = health_pb2_grpc.HealthStub(harness.channel)
    watches = [
        health.Watch(health_pb2.HealthCheckRequest(service=entry.service_name))
        for entry in CONTRACTS
    ]
    for watch in watches:
        assert (await watch.read()).status == SERVING
    stop = asyncio.create_task(harness.server.drain_and_stop())
    for watch in watches:
        heard = []
        while (message := await watch.read()) is not grpc.aio.EOF:
            heard.append(message.status)
        assert heard == [NOT_SERVING]
        assert await watch.code() == grpc.StatusCode.OK
    await stop
