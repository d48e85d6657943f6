"""Killing the real engine's core process: streams fail fast, health flips, the process exits 1."""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from vllm_router.proto import vllm_engine_pb2 as pb
from vllm_router.proto import vllm_engine_pb2_grpc as pb_grpc
from vllm_router.proto import vllm_native_pb2 as npb
from vllm_router.proto import vllm_native_pb2_grpc as npb_grpc

import servers
from harness import read_rest, request
from real_engine import ENGINE_FLAGS, cli_flags, require_vllm, tiny_model

pytestmark = pytest.mark.vllm


def _engine_core(pid: int) -> psutil.Process:
    for child in psutil.Process(pid).children(recursive=True):
        if "EngineCore" in " ".join([child.name(), *child.cmdline()]):
            return child
    raise AssertionError("no EngineCore process found")


# What a health probe can hear from a worker whose engine died: NOT_SERVING while it drains,
# the call refused once the server has begun to stop.
NOT_SERVING = (health_pb2.HealthCheckResponse.NOT_SERVING, "CANCELLED", "UNAVAILABLE")


def _named(heard: object) -> object:
    """A serving status by its name (a refused probe is named by its status code already)."""
    if isinstance(heard, int):
        return health_pb2.HealthCheckResponse.ServingStatus.Name(heard)  # type: ignore[arg-type]
    return heard


async def _health_now(health: health_pb2_grpc.HealthStub) -> object:
    try:
        return (await health.Check(health_pb2.HealthCheckRequest(), timeout=5)).status
    except grpc.aio.AioRpcError as err:
        return err.code().name


# Streams long enough that none can end before the kill on a slow machine: 240 tokens
# (the session's context) once all finished in CI between the first token and the kill.
LONG_CONTEXT = 2048
LONG_STREAM = LONG_CONTEXT - 8


async def test_killing_the_engine_core_mid_stream(figures) -> None:
    require_vllm()
    model = tiny_model()
    flags = cli_flags({**ENGINE_FLAGS, "max_model_len": LONG_CONTEXT})
    # The health poll is far away: only the death signal itself can flip health in time.
    server = await servers.start(
        "--model", str(model), "--port", "0", "--health-poll-seconds", "30", *flags,
        timeout=240,
    )  # fmt: skip
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = pb_grpc.VllmEngineStub(channel)
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
            streams = [
                stub.GenerateStream(request([5 + i, 6, 7], max_tokens=LONG_STREAM, ignore_eos=True))
                for i in range(16)
            ]
            for stream in streams:
                await stream.read()
            _engine_core(server.process.pid).kill()
            killed = time.monotonic()
            health = health_pb2_grpc.HealthStub(channel)
            codes = []
            health_after_first_failure = None
            for stream in streams:
                try:
                    await asyncio.wait_for(read_rest(stream), 10)
                    codes.append("OK")
                except grpc.aio.AioRpcError as err:
                    codes.append(err.code().name)
                    if health_after_first_failure is None:
                        health_after_first_failure = await _health_now(health)
            ended_after = time.monotonic() - killed
            assert "UNAVAILABLE" in codes and set(codes) <= {"UNAVAILABLE", "OK"}, codes
            # A stream heard of the death: every health answer already had. (Or the worker
            # already stops, as engine death makes it, and refuses the probe: not SERVING either.)
            assert health_after_first_failure in NOT_SERVING, health_after_first_failure
            assert ended_after < 5, ended_after
            statuses = []
            while (message := await asyncio.wait_for(watch.read(), 10)) is not grpc.aio.EOF:
                statuses.append(message.status)
            # NOT_SERVING, then the watch ends with OK as the worker stops: a goodbye.
            assert statuses[-1] == health_pb2.HealthCheckResponse.NOT_SERVING, statuses
            assert await watch.code() == grpc.StatusCode.OK
        exit_code = await server.wait(60)
        figures(
            f"engine core killed with 16 streams in flight: {codes.count('UNAVAILABLE')} ended "
            f"UNAVAILABLE, {codes.count('OK')} had finished, all within {ended_after:.2f}s; "
            f"health probe then: {_named(health_after_first_failure)}; "
            f"process exit code {exit_code}"
        )
        assert exit_code == 1
    finally:
        server.kill()


# The watchdog's limits here (a tiny model steps in milliseconds): out of rotation at the
# first, failed at the second. A stop between them ends soon after the first: a core resumed
# on a loaded machine gets 7 s to step before the second (3 s once was not enough in a
# full suite run).
STALL_TIMEOUT = 4.0
STALL_EXIT = 12.0
SHORT_STOP = STALL_TIMEOUT / 4  # only slow: a margin of 3 s for a loaded machine
ATTEMPTS = 5  # rounds to catch a stream mid-answer at the stop


async def _outcome(call: grpc.aio.UnaryStreamCall, timeout: float) -> tuple[object, str]:
    """How a stream read to its end ended: UNAVAILABLE and its details, or OK and what it
    finished with ("length 249": the finish reason and the tokens after the first message)."""
    try:
        rest = await asyncio.wait_for(read_rest(call), timeout)
    except grpc.aio.AioRpcError as err:
        return err.code(), err.details() or ""
    return grpc.StatusCode.OK, f"{rest[-1].finish_reason} {sum(len(m.token_ids) for m in rest)}"


async def _until_health(
    health: health_pb2_grpc.HealthStub,
    wanted: object,
    within: float,
    server: servers.ServerProcess,
) -> float:
    """Seconds until health says `wanted` (polled every 0.1 s); fails after `within`,
    showing the server's watchdog lines and the end of its log."""
    started = time.monotonic()
    while (heard := await _health_now(health)) != wanted:
        assert time.monotonic() - started < within, (
            f"health still {_named(heard)}: {_stall_lines(server)} ... {server.log[-15:]}"
        )
        await asyncio.sleep(0.1)
    return time.monotonic() - started


async def test_a_stopped_engine_core_leaves_rotation_then_is_found_stuck(figures) -> None:
    """The engine core stopped (SIGSTOP: what a wedged GPU step or collective, or a very long
    one, looks like from outside). A short stop is only slow. A stop between the two limits
    takes the worker out of rotation (NOT_SERVING, new requests refused) and back when the
    core goes on, with every token of the stream in flight delivered and the process alive.
    A PauseGeneration(KEEP) held past both limits is never judged. A stop past the second
    fails every request UNAVAILABLE and makes the worker exit 1, the core still stopped."""
    require_vllm()
    server = await servers.start(
        "--model", str(tiny_model()), "--port", "0", "--health-poll-seconds", "30",
        "--engine-stall-timeout-seconds", str(STALL_TIMEOUT),
        "--engine-stall-exit-seconds", str(STALL_EXIT), *cli_flags(), timeout=240,
    )  # fmt: skip
    core = _engine_core(server.process.pid)
    serving = health_pb2.HealthCheckResponse.SERVING
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = pb_grpc.VllmEngineStub(channel)
            health = health_pb2_grpc.HealthStub(channel)
            control = npb_grpc.ControlStub(channel)
            # A fresh engine's first steps of a shape can be slow on a loaded machine; what
            # is timed below is the stop alone.
            await read_rest(stub.GenerateStream(request([5, 6], max_tokens=32, ignore_eos=True)))
            # A stop well inside the first limit: the stream finishes, nothing is failed.
            stream = stub.GenerateStream(request([5, 6, 7], max_tokens=200, ignore_eos=True))
            await stream.read()
            core.suspend()
            await asyncio.sleep(SHORT_STOP)
            core.resume()
            rest = await asyncio.wait_for(read_rest(stream), 60)
            assert rest[-1].finish_reason == "length"
            assert (await _health_now(health)) == serving, _stall_lines(server)

            # Between the limits: out of rotation, then back, every stream whole: one begun
            # before the stop (the tiny model may finish it first) and one sent to the
            # stopped core (certain to be in flight across the stall).
            begun = stub.GenerateStream(request([5, 6, 8], max_tokens=250, ignore_eos=True))
            await begun.read()
            core.suspend()
            stopped = time.monotonic()
            sent = stub.GenerateStream(request([5, 6, 10], max_tokens=250, ignore_eos=True))
            left = await _until_health(
                health, health_pb2.HealthCheckResponse.NOT_SERVING, STALL_TIMEOUT + 3, server
            )
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Generate(request([5], max_tokens=2), timeout=5)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "out of rotation" in (refused.value.details() or "")
            core.resume()
            stopped_for = time.monotonic() - stopped
            assert STALL_TIMEOUT < stopped_for < STALL_EXIT - 3, stopped_for
            back = await _until_health(health, serving, 10, server)
            assert await _outcome(begun, 60) == (grpc.StatusCode.OK, "length 249")
            assert (await sent.read()).token_ids  # its first message, after the stall
            assert await _outcome(sent, 60) == (grpc.StatusCode.OK, "length 249")
            assert server.process.returncode is None

            # Held on purpose past both limits, a request frozen in it: never judged.
            native = npb_grpc.InferenceStub(channel)
            frozen = native.GenerateStream(_native_request([5, 6, 9], 400))
            await frozen.read()
            await control.PauseGeneration(npb.PauseGenerationRequest(mode=npb.PAUSE_MODE_KEEP))
            await asyncio.sleep(STALL_EXIT + 2)
            assert (await _health_now(health)) == serving
            await control.ResumeGeneration(npb.ResumeGenerationRequest())
            rest = await asyncio.wait_for(read_rest(frozen), 60)
            assert rest[-1].outputs.finish_info.finish_reason == npb.LENGTH
            assert server.process.returncode is None

            # Stopped for good: out of rotation at the first limit, then every request in
            # flight ends UNAVAILABLE, saying why. Four streams have begun before the core
            # stops; a starved client may reach the stop only after the tiny model has
            # produced them whole (it needs a fraction of a second), so what must fail is
            # exactly what the server holds once the core's last outputs have settled, and the
            # round is run again (after a short stop, which fails nothing) until that includes
            # a stream caught mid-answer.
            rounds = 0
            while True:
                rounds += 1
                streams = [
                    stub.GenerateStream(request([5 + i, 6], max_tokens=250, ignore_eos=True))
                    for i in range(4)
                ]
                for call in streams:
                    await call.read()
                core.suspend()
                stopped = time.monotonic()
                # Requests that arrive at the stopped engine before it is judged hang with the
                # rest, and fail with them.
                streams += [stub.GenerateStream(request([9, 9], max_tokens=8)) for _ in range(2)]
                await asyncio.sleep(1.0)  # well inside the first limit
                held = (await stub.GetLoads(pb.GetLoadsRequest(), timeout=5)).requests_in_flight
                if held > 2:
                    break
                assert rounds < ATTEMPTS, f"in {ATTEMPTS} rounds no stream was running at the stop"
                core.resume()
                for call in streams:
                    assert (await _outcome(call, 60))[0] == grpc.StatusCode.OK
            await _until_health(
                health, health_pb2.HealthCheckResponse.NOT_SERVING, STALL_TIMEOUT + 3, server
            )  # out of rotation first, the streams still open
            left_again = time.monotonic() - stopped
            assert held == (await stub.GetLoads(pb.GetLoadsRequest())).requests_in_flight
            outcomes = [await _outcome(call, STALL_EXIT + 20) for call in streams]
            details = [detail for code, detail in outcomes if code == grpc.StatusCode.UNAVAILABLE]
            finished = [detail for code, detail in outcomes if code == grpc.StatusCode.OK]
            assert len(details) + len(finished) == len(streams), outcomes
            assert len(details) == held, (held, outcomes)
            assert all(tokens == "length 249" for tokens in finished), finished
            ended_after = time.monotonic() - stopped
            assert all("stopped making progress" in d for d in details), details
            heard = await _health_now(health)
            assert heard in NOT_SERVING, heard
            exit_code = await server.wait(60)
        figures(
            f"limits {STALL_TIMEOUT:.0f}s/{STALL_EXIT:.0f}s: core stopped "
            f"{SHORT_STOP:.0f}s: stream finished, SERVING; stopped "
            f"{stopped_for:.1f}s: NOT_SERVING after {left:.1f}s, SERVING "
            f"{back:.1f}s after the core went on, both streams whole; paused (keep) "
            f"{STALL_EXIT + 2:.0f}s: SERVING throughout; stopped for good (round {rounds}): "
            f"NOT_SERVING after {left_again:.1f}s, then {len(details) - 2} of 4 streams in "
            "flight and 2 new ones "
            f"UNAVAILABLE after {ended_after:.1f}s, health {_named(heard)}, exit code {exit_code}"
        )
        assert left_again < STALL_EXIT - 1, left_again
        assert exit_code == 1
        assert STALL_EXIT - 1 < ended_after < STALL_EXIT + 3, ended_after
    finally:
        server.kill()
        with contextlib.suppress(psutil.Error):
            core.kill()


def _stall_lines(server: servers.ServerProcess) -> list[str]:
    """The server's log lines about the watchdog, for a failed assertion to show."""
    return [line for line in server.log if "stall" in line.lower() or "Health" in line]


def _native_request(ids: list[int], max_new: int) -> npb.GenerateRequest:
    return npb.GenerateRequest(
        token_ids=npb.TokenIds(ids=ids),
        temperature=0.0,
        stopping=npb.StoppingCriteria(max_new_tokens=max_new, ignore_eos=True),
        response=npb.ResponseOptions(output_token_ids=True, output_text=False),
    )
