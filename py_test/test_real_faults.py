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

import servers
from harness import read_rest, request
from real_engine import cli_flags, require_vllm, tiny_model

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


async def test_killing_the_engine_core_mid_stream(figures) -> None:
    require_vllm()
    model = tiny_model()
    # The health poll is far away: only the death signal itself can flip health in time.
    server = await servers.start(
        "--model", str(model), "--port", "0", "--health-poll-seconds", "30", *cli_flags(),
        timeout=240,
    )  # fmt: skip
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = pb_grpc.VllmEngineStub(channel)
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
            streams = [
                stub.GenerateStream(request([5 + i, 6, 7], max_tokens=240, ignore_eos=True))
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
            # A stream heard of the death: every health answer already had. (Or the worker
            # already stops, as engine death makes it, and refuses the probe: not SERVING either.)
            assert health_after_first_failure in NOT_SERVING, health_after_first_failure
            ended_after = time.monotonic() - killed
            assert "UNAVAILABLE" in codes and set(codes) <= {"UNAVAILABLE", "OK"}, codes
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


STALL_TIMEOUT = 4.0  # --engine-stall-timeout-seconds here: a tiny model steps in milliseconds
ATTEMPTS = 5  # rounds to catch a stream mid-answer at the stop


async def _outcome(call: grpc.aio.UnaryStreamCall, timeout: float) -> tuple[object, str]:
    """How a stream read to its end ended: UNAVAILABLE and its details, or OK and what it
    finished with ("length 249": the finish reason and the tokens after the first message)."""
    try:
        rest = await asyncio.wait_for(read_rest(call), timeout)
    except grpc.aio.AioRpcError as err:
        return err.code(), err.details() or ""
    return grpc.StatusCode.OK, f"{rest[-1].finish_reason} {sum(len(m.token_ids) for m in rest)}"


async def test_a_stopped_engine_core_is_found_stuck(figures) -> None:
    """The engine core stopped (SIGSTOP: what a wedged GPU step or collective looks like from
    outside): a short stop is only slow; a long one fails every request UNAVAILABLE, flips
    health to NOT_SERVING and makes the worker exit 1, while the core is still stopped."""
    require_vllm()
    server = await servers.start(
        "--model", str(tiny_model()), "--port", "0", "--health-poll-seconds", "30",
        "--engine-stall-timeout-seconds", str(STALL_TIMEOUT), *cli_flags(), timeout=240,
    )  # fmt: skip
    core = _engine_core(server.process.pid)
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = pb_grpc.VllmEngineStub(channel)
            health = health_pb2_grpc.HealthStub(channel)
            # A pause shorter than the timeout: the stream finishes, nothing is failed.
            stream = stub.GenerateStream(request([5, 6, 7], max_tokens=200, ignore_eos=True))
            await stream.read()
            core.suspend()
            await asyncio.sleep(STALL_TIMEOUT / 2)
            core.resume()
            rest = await asyncio.wait_for(read_rest(stream), 60)
            assert rest[-1].finish_reason == "length"
            assert (await _health_now(health)) == health_pb2.HealthCheckResponse.SERVING
            # Stopped for good: every request in flight ends UNAVAILABLE, saying why. Four
            # streams have begun before the core stops; a starved client may reach the stop
            # only after the tiny model has produced them whole (it needs a fraction of a
            # second), so what must fail is exactly what the server holds once the core's last
            # outputs have settled, and the round is run again (after a short stop, which fails
            # nothing) until that includes a stream caught mid-answer.
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
                # Requests that arrive at the stopped engine hang with the rest, and fail with
                # them.
                streams += [stub.GenerateStream(request([9, 9], max_tokens=8)) for _ in range(2)]
                await asyncio.sleep(1.0)  # well inside the timeout
                held = (await stub.GetLoads(pb.GetLoadsRequest(), timeout=5)).requests_in_flight
                if held > 2:
                    break
                assert rounds < ATTEMPTS, f"in {ATTEMPTS} rounds no stream was running at the stop"
                core.resume()
                for call in streams:
                    assert (await _outcome(call, 60))[0] == grpc.StatusCode.OK
            outcomes = [await _outcome(call, STALL_TIMEOUT + 20) for call in streams]
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
            f"engine core stopped {STALL_TIMEOUT / 2:.0f}s: stream finished, SERVING; stopped "
            f"for good (round {rounds}): {len(details) - 2} of 4 streams in flight and 2 new "
            f"ones UNAVAILABLE "
            f"after {ended_after:.1f}s (timeout {STALL_TIMEOUT:.0f}s), health {_named(heard)}, "
            f"exit code {exit_code}"
        )
        assert exit_code == 1
        assert ended_after < STALL_TIMEOUT + 3, ended_after
    finally:
        server.kill()
        with contextlib.suppress(psutil.Error):
            core.kill()
