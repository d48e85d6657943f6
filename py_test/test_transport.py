"""--transport: grpcio (grpc.aio, the default) and native (pygrpc-native, opt-in).

What native cannot honour is refused at start in one line; clients that stop reading hold
no thread and no unbounded buffer on either transport; keepalive and the client-ping policy
as each transport has them; and the mock-engine suite run again on native, in a pytest
subprocess (VLLM_SERVICER_TRANSPORT=native: harness.py and servers.py honour it).
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import re
import subprocess
import sys
import time
import types
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from vllm_router.proto import vllm_engine_pb2_grpc as pb_grpc
from vllm_router.server import ServerConfig, StartupError, preflight, transport
from vllm_router.server.config import (
    DEFAULT_MIN_CLIENT_PING_INTERVAL_MS,
    TRANSPORTS,
    server_options,
)
from vllm_router.server.registry import CONTRACTS
from vllm_router.server.transport import check_transport, native_options
from vllm_router.testing.mock_engine import MockAsyncEngine, MockConfig

import servers
from harness import (
    Harness,
    StartServer,
    collect_stream,
    read_rest,
    request,
    require,
    start_harness,
    wait_until,
)

ROOT = Path(__file__).resolve().parent.parent


def _native_installed() -> bool:
    return importlib.util.find_spec("pygrpc_native") is not None


def _require(name: str) -> None:
    if name == "native":
        require(_native_installed(), "pygrpc-native is not installed (make test installs it)")


def _refusal(config: ServerConfig) -> str:
    """The one-line StartupError preflight gives for `config`."""
    with pytest.raises(StartupError) as err:
        preflight(config)
    message = str(err.value)
    assert "\n" not in message, message
    return message


# -- what native cannot honour: refused at start, in one line --------------------------------------


def test_an_unknown_transport_is_refused_naming_both() -> None:
    message = _refusal(ServerConfig(port=0, transport="quic"))
    assert "'quic'" in message and "grpcio" in message and "native" in message


def test_native_refuses_tls(pki) -> None:
    for mutual in (False, True):
        config = ServerConfig(
            port=0,
            transport="native",
            ssl_certfile=str(pki["server_cert_path"]),
            ssl_keyfile=str(pki["server_key_path"]),
            ssl_ca_certs=str(pki["ca_path"]) if mutual else None,
        )
        message = _refusal(config)
        assert "no TLS" in message and "--ssl-certfile" in message
        assert "--transport grpcio" in message
    # The same TLS settings on grpcio pass.
    preflight(
        ServerConfig(port=0, ssl_certfile=config.ssl_certfile, ssl_keyfile=config.ssl_keyfile)
    )


def test_native_refuses_a_unix_socket_beside_tcp(tmp_path: Path) -> None:
    uds = str(tmp_path / "w.sock")
    message = _refusal(ServerConfig(port=0, transport="native", uds=uds))
    assert "one listener" in message and "--port -1" in message
    preflight(ServerConfig(port=0, uds=uds))  # grpcio serves both


def test_native_refuses_a_client_ping_interval() -> None:
    """Native polices no client pings: the interval is refused, like every setting it cannot
    honour, not dropped without a word; grpcio takes it (and has its default without it)."""
    for interval in (500, 10_000):
        config = ServerConfig(port=0, transport="native", min_client_ping_interval_ms=interval)
        message = _refusal(config)
        assert "--min-client-ping-interval-ms" in message and "--transport grpcio" in message
        preflight(ServerConfig(port=0, min_client_ping_interval_ms=interval))
    key = "grpc.http2.min_ping_interval_without_data_ms"
    assert (key, DEFAULT_MIN_CLIENT_PING_INTERVAL_MS) in server_options(ServerConfig())
    assert (key, 10_000) in server_options(ServerConfig(min_client_ping_interval_ms=10_000))
    assert key not in dict(transport.native_options(ServerConfig(transport="native")))


def test_native_alone_on_a_unix_socket_passes(tmp_path: Path) -> None:
    _require("native")
    preflight(ServerConfig(port=-1, transport="native", uds=str(tmp_path / "w.sock")))


def test_native_without_pygrpc_native_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("pygrpc_native", "pygrpc_native.aio"):
        monkeypatch.setitem(sys.modules, name, None)  # import fails, as when not installed
    message = _refusal(ServerConfig(port=0, transport="native"))
    assert "pygrpc-native==0.5.0" in message and "not installed" in message
    assert "vllm-servicer[native]" in message


def test_native_of_another_release_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    _require("native")
    import pygrpc_native

    monkeypatch.setattr(pygrpc_native, "__version__", "0.6.0")
    message = _refusal(ServerConfig(port=0, transport="native"))
    assert "0.5.0 exactly" in message and "0.6.0" in message


def test_native_without_the_send_path_it_replaces_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _require("native")
    import pygrpc_native.aio

    monkeypatch.delattr(pygrpc_native.aio.Server, "_send")
    monkeypatch.delattr(pygrpc_native.aio, "STREAM_FULL")
    # A front without call counts: the stop override could not tell what is written.
    front = type("Front", (), {"stream_try_send": lambda self, call_id, payload: 0})
    monkeypatch.setattr(pygrpc_native.aio, "NativeGrpcFront", front)
    message = _refusal(ServerConfig(port=0, transport="native"))
    assert "Server._send" in message and "STREAM_FULL" in message
    assert "NativeGrpcFront.metrics" in message and "stream_try_send" not in message


def test_native_without_what_a_direct_send_reads_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _require("native")
    import pygrpc_native.aio

    class Call:  # a release whose call no longer keeps its handler
        def __init__(self, call_id: int) -> None:
            self.call_id = call_id
            self.task = None

    monkeypatch.setattr(pygrpc_native.aio, "_Call", Call)
    message = _refusal(ServerConfig(port=0, transport="native"))
    assert "_Call.handler" in message and "_Call.call_id" not in message


def test_a_direct_send_takes_what_upstreams_send_takes_and_fails_what_it_fails() -> None:
    """`transport_send` looks up once what upstream's encoder looks up per message; what
    is not plain bytes under the send limit goes upstream's way, which fails the call."""
    _require("native")
    import pygrpc_native

    from vllm_router.server.transport import _native_module, _polling_send_server

    server_class = _polling_send_server(_native_module())
    server: Any = object.__new__(server_class)
    sent: list[tuple[int, bytes]] = []
    replies = [pygrpc_native.STREAM_SENT, pygrpc_native.aio.STREAM_FULL]

    class Front:
        def stream_try_send(self, call_id: int, data: bytes) -> int:
            sent.append((call_id, data))
            return replies.pop(0)

    failed: list[str] = []
    server._front, server._send_limit = Front(), 8
    server._failed = lambda call, context, exc: failed.append(f"{type(exc).__name__}: {exc}")
    server._within_send_limit = lambda call, data: (
        None if len(data) > 8 else data  # upstream fails the call and sends nothing
    )

    unencodable = object()

    def serialize(message: Any) -> Any:
        if message is unencodable:
            raise ValueError("cannot encode")
        return message

    handler = grpc.unary_stream_rpc_method_handler(None, response_serializer=serialize)
    call, context = types.SimpleNamespace(call_id=7, handler=handler), types.SimpleNamespace()
    context._closed = False
    send = server.transport_send(call, context)
    assert send(b"one") is True and send(b"two") is False  # taken; the client's window full
    assert sent == [(7, b"one"), (7, b"two")]
    assert send(b"far too long") is False and send(unencodable) is False
    assert sent == [(7, b"one"), (7, b"two")] and failed == ["ValueError: cannot encode"]
    context._closed = True
    assert send(b"late") is False and len(sent) == 2


def test_an_option_native_refuses_is_a_startup_error(monkeypatch: pytest.MonkeyPatch) -> None:
    _require("native")
    refused = [("grpc.max_connection_age_ms", 60_000)]  # pygrpc-native cannot close by age
    monkeypatch.setattr(transport, "native_options", lambda config: refused)
    message = _refusal(ServerConfig(port=0, transport="native"))
    assert "cannot serve this configuration" in message and "max_connection_age_ms" in message


def test_native_options_drop_what_it_ignores_and_lift_its_stream_cap() -> None:
    config = ServerConfig(max_message_bytes=1234, keepalive_time_ms=777)
    options = dict(native_options(config))
    assert options["grpc.max_receive_message_length"] == 1234
    assert options["grpc.max_send_message_length"] == 1234
    assert options["grpc.keepalive_time_ms"] == 777
    assert options["grpc.max_concurrent_streams"] >= 2**31 - 1
    assert not {
        "grpc.http2.min_ping_interval_without_data_ms",
        "grpc.http2.max_ping_strikes",
    } & set(options)
    check_transport(ServerConfig())  # grpcio needs nothing more


def test_the_cli_refuses_in_one_line_and_lists_the_choices(pki) -> None:
    cert, key = str(pki["server_cert_path"]), str(pki["server_key_path"])
    tls = ("--ssl-certfile", cert, "--ssl-keyfile", key)
    cases = {
        ("--transport", "native", *tls): (1, "no TLS"),
        ("--transport", "quic"): (2, "invalid choice: 'quic'"),
    }
    for flags, (code, said) in cases.items():
        result = subprocess.run(
            servers.command("--mock-engine", "--port", "0", *flags, without_vllm=True),
            capture_output=True,
            text=True,
            timeout=60,
        )
        lines = result.stderr.strip().splitlines()
        assert result.returncode == code, result.stderr
        assert said in lines[-1] and "Traceback" not in result.stderr, result.stderr
        if code == 1:
            assert len(lines) == 1, result.stderr


# -- clients that stop reading ---------------------------------------------------------------------

STALLED_CLIENTS = 16
# The event loop's default executor is where upstream's send (pygrpc-native 0.5.0) parks a
# thread per stalled stream. asyncio sizes it by the machine (min(32, CPUs + 4) threads): on
# more than 12 CPUs it has a thread to spare for 16 stalled clients, and a send that holds
# threads would go unseen. The test pins it to a 2-CPU machine's size, fewer threads than
# stalled clients, so it catches one on a machine of any size.
DEFAULT_EXECUTOR_THREADS = 6
assert DEFAULT_EXECUTOR_THREADS < STALLED_CLIENTS
STALL_TIMEOUT = 2.0
# A connection of its own per stalled client (channels to one address share one by default),
# with a fixed 64 KiB window (no BDP growth): the 16 streams back up within a second, well
# before the watchdog's 2 s (grown windows take several seconds to fill on two cores).
STALLED_CLIENT = [
    ("grpc.use_local_subchannel_pool", 1),
    ("grpc.http2.bdp_probe", 0),
    ("grpc.http2.lookahead_bytes", 65536),
]


def _rss_mb() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _blocked_on_send(harness: Harness, longer_than: float) -> set[str]:
    """Requests whose next message has waited longer than this for its client to take it."""
    now = time.monotonic()
    flights = harness.server.requests._flights  # what the stall watchdog itself reads
    return {
        request_id
        for request_id, flight in flights.items()
        if (since := flight.stalled_since()) is not None and now - since > longer_than
    }


async def _status_after_the_rest(call: grpc.aio.UnaryStreamCall) -> grpc.StatusCode:
    try:
        while await call.read() is not grpc.aio.EOF:
            pass
    except grpc.aio.AioRpcError as err:
        return err.code()
    return await call.code()


@pytest.mark.parametrize("transport_name", TRANSPORTS)
async def test_clients_that_stop_reading_hold_no_thread_and_are_cancelled(
    transport_name: str, start_mock: StartServer, figures, monkeypatch: pytest.MonkeyPatch
) -> None:
    """16 clients stop reading long streams: the default executor (pinned to 6 threads) stays
    free (the bug transport.py works around on native), another client's stream runs, memory
    stays bounded; the stall watchdog cancels them all and the engine is left idle."""
    _require(transport_name)
    pinned = ThreadPoolExecutor(DEFAULT_EXECUTOR_THREADS, thread_name_prefix="asyncio-pinned")
    # Restored (before the server stops) when the test ends.
    monkeypatch.setattr(asyncio.get_running_loop(), "_default_executor", pinned)
    config = ServerConfig(
        port=0,
        transport=transport_name,
        stream_stall_timeout_seconds=STALL_TIMEOUT,
        shutdown_grace_seconds=2.0,
    )
    harness = await start_mock(config, tokens_per_step=2000, max_model_len=50_000_000)
    await collect_stream(harness.stub, request([20], max_tokens=4000, ignore_eos=True))  # warm
    rss_before = _rss_mb()
    channels = [
        grpc.aio.insecure_channel(harness.address, options=STALLED_CLIENT)
        for _ in range(STALLED_CLIENTS)
    ]
    ids = {f"stalled-{i}" for i in range(STALLED_CLIENTS)}
    stalled: list[grpc.aio.UnaryStreamCall] = []
    try:
        for i, channel in enumerate(channels):
            long = request([10], f"stalled-{i}", max_tokens=40_000_000, ignore_eos=True)
            stalled.append(pb_grpc.VllmEngineStub(channel).GenerateStream(long))
        # Each reads one message, then never again: flow control backs up into the server.
        await asyncio.gather(*(call.read() for call in stalled))
        await wait_until(
            lambda: _blocked_on_send(harness, 0.2) >= ids,
            timeout=STALL_TIMEOUT,
            what="every stalled client's stream blocked on a send",
        )
        stalled_at = time.monotonic()
        rss_held = _rss_mb()
        # Meanwhile the default executor still has a thread, and another client reads a
        # stream to its end.
        started = time.monotonic()
        assert await asyncio.wait_for(asyncio.to_thread(lambda: "ran"), 1.0) == "ran"
        to_thread_ms = (time.monotonic() - started) * 1000
        started = time.monotonic()
        reader = request([20], "reader", max_tokens=20_000, ignore_eos=True)
        messages = await asyncio.wait_for(collect_stream(harness.stub, reader), 1.0)
        reader_ms = (time.monotonic() - started) * 1000
        assert messages[-1].is_finished and messages[-1].usage.completion_tokens == 20_000
        # All that ran while all 16 were still held (the watchdog had not fired yet).
        assert ids <= harness.server.requests.in_flight
        await asyncio.sleep(0.2)
        rss_later = _rss_mb()
        # The stall watchdog cancels every stalled stream; the engine is left idle.
        await wait_until(
            lambda: (
                ids <= set(harness.engine.aborted_ids) and not harness.server.requests.in_flight
            ),
            timeout=15,
            what="the stall watchdog cancelled every stalled stream",
        )
        cancelled_after = time.monotonic() - stalled_at
        load = harness.engine.load()
        assert (load.running_requests, load.waiting_requests) == (0, 0)
        if transport_name == "native":
            # Its clients hear CANCELLED once they read what was sent before. (grpcio sends
            # them nothing: one that reads again gets the messages sent before, then waits
            # for its own deadline; measured, also with the server in another process.)
            codes = await asyncio.wait_for(
                asyncio.gather(*(_status_after_the_rest(call) for call in stalled)), 60
            )
            assert set(codes) == {grpc.StatusCode.CANCELLED}, codes
        # And the server is as before: a thread for to_thread, a stream to the end.
        assert await asyncio.wait_for(asyncio.to_thread(lambda: "again"), 1.0) == "again"
        again = await asyncio.wait_for(collect_stream(harness.stub, request([20], max_tokens=3)), 5)
        assert again[-1].usage.completion_tokens == 3
    finally:
        for call in stalled:
            call.cancel()
        for channel in channels:
            await channel.close()
        pinned.shutdown(wait=False)
    # Bounded: the 16 streams' buffers (server's and, here in-process, the clients' windows)
    # are a fixed amount, and do not grow while the clients stay stalled.
    held, growth = rss_held - rss_before, rss_later - rss_held
    assert held < 400 and growth < 32, (held, growth)
    figures(
        f"{transport_name}: {STALLED_CLIENTS} clients stopped reading: to_thread {to_thread_ms:.1f}"
        f" ms and a 10-message stream {reader_ms:.0f} ms meanwhile; RSS +{held:.0f} MB held, "
        f"{growth:+.1f} MB over the next {0.2 + (reader_ms + to_thread_ms) / 1000:.1f} s; all "
        f"cancelled {cancelled_after:.1f}s after stalling (watchdog {STALL_TIMEOUT:.0f} s), "
        f"engine idle" + (", clients told CANCELLED" if transport_name == "native" else "")
    )


STOP_ROUNDS = 12  # servers stopped the moment their calls end (native lost ~1 in 6 ends)


@pytest.mark.parametrize("transport_name", TRANSPORTS)
async def test_what_ends_as_the_server_stops_reaches_the_client(
    transport_name: str, figures
) -> None:
    """A drain's last answer, and each health watch's NOT_SERVING then OK, reach their
    clients whole although the server stops the moment they end: on native, upstream's stop
    closed the front before its I/O threads had written them (transport.py's stop waits)."""
    _require(transport_name)
    lost: list[str] = []
    for round_ in range(STOP_ROUNDS):
        config = ServerConfig(port=0, transport=transport_name, shutdown_grace_seconds=2.0)
        harness = await start_harness(MockAsyncEngine(MockConfig(step_delay=0.001)), config)
        health = health_pb2_grpc.HealthStub(harness.channel)
        watches = {
            entry.service_name: health.Watch(
                health_pb2.HealthCheckRequest(service=entry.service_name)
            )
            for entry in CONTRACTS
        }
        for watch in watches.values():
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
        answer = harness.stub.GenerateStream(request([10], max_tokens=30, ignore_eos=True))
        await answer.read()
        stop = asyncio.create_task(harness.server.drain_and_stop())
        try:
            rest = await read_rest(answer)
            tokens = 1 + sum(len(m.token_ids) for m in rest)
            if tokens != 30 or rest[-1].finish_reason != "length":
                lost.append(f"round {round_}: the answer ended after {tokens} tokens")
        except grpc.aio.AioRpcError as err:
            lost.append(f"round {round_}: the answer: {err.code().name} {err.details()}")
        for service, watch in watches.items():
            try:
                heard = [m.status for m in await read_rest(watch)]
                if heard != [health_pb2.HealthCheckResponse.NOT_SERVING]:
                    lost.append(f"round {round_}: watch {service!r} heard {heard}")
            except grpc.aio.AioRpcError as err:
                lost.append(f"round {round_}: watch {service!r}: {err.code().name} {err.details()}")
        await stop
        await harness.channel.close()
    assert not lost, lost
    figures(
        f"{transport_name}: {STOP_ROUNDS} servers stopped as their calls ended: every answer "
        f"and all {STOP_ROUNDS * len(CONTRACTS)} watches' goodbyes arrived"
    )


async def _messages_read_in(address: str, seconds: float) -> int:
    """How many messages a client reading as fast as it can takes in `seconds` of a stream
    the engine writes faster: its window is full most of the time."""
    read = 0
    async with grpc.aio.insecure_channel(address) as channel:
        stream = pb_grpc.VllmEngineStub(channel).GenerateStream(
            request([10], max_tokens=1_000_000, ignore_eos=True, n=64), timeout=seconds
        )
        try:
            async for _ in stream:
                read += 1
        except grpc.aio.AioRpcError as err:
            assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err
    return read


async def test_a_client_slower_than_the_engine_reads_as_fast_on_native(figures) -> None:
    """The send that waits on the loop (transport.py) must not slow a stream whose client
    reads, only slower than the engine writes. Sleeping 1 ms per full window read a tenth
    of grpcio's rate (measured); upstream's thread-blocking send kept pace. The server runs
    in a process of its own: one sharing this client's GIL measures the GIL."""
    _require("native")
    rates = {}
    for name in TRANSPORTS:
        server = await servers.start(
            "--mock-engine", "--port", "0", "--mock-max-model-len", "2000000", "--transport", name
        )
        try:
            rates[name] = await _messages_read_in(server.address, 2.0) / 2.0
        finally:
            await server.stop()
    assert rates["native"] >= 0.5 * rates["grpcio"], rates
    figures(", ".join(f"{name} {rate:,.0f} messages/s" for name, rate in rates.items()))


# -- keepalive and client pings, on the wire -------------------------------------------------------

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
SETTINGS, PING, GOAWAY = 0x4, 0x6, 0x7
ACK = 0x1


def _frame(kind: int, flags: int = 0, payload: bytes = b"") -> bytes:
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + bytes(4) + payload


async def _read_frame(reader: asyncio.StreamReader) -> tuple[int, int, bytes]:
    header = await reader.readexactly(9)
    payload = await reader.readexactly(int.from_bytes(header[:3], "big"))
    return header[3], header[4], payload


@dataclass
class Seen:
    """What a raw peer saw of the server."""

    pings: int = 0  # pings the server sent (never acknowledged)
    goaway: bytes | None = None  # the debug data of the server's GOAWAY
    closed_after: float | None = None  # seconds until the server closed the connection


async def _raw_peer(port: int, ping_every: float | None, seconds: float) -> Seen:
    """An HTTP/2 peer with no calls that acknowledges settings and never the server's pings;
    with `ping_every`, it pings that often itself. What it saw in `seconds` or until closed."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(PREFACE + _frame(SETTINGS))
    seen = Seen()
    started = time.monotonic()

    async def pinger() -> None:
        while ping_every is not None:
            writer.write(_frame(PING, payload=bytes(8)))
            await asyncio.sleep(ping_every)

    async def watch() -> None:
        try:
            while True:
                kind, flags, payload = await _read_frame(reader)
                if kind == SETTINGS and not flags & ACK:
                    writer.write(_frame(SETTINGS, ACK))
                elif kind == PING and not flags & ACK:
                    seen.pings += 1
                elif kind == GOAWAY:
                    seen.goaway = payload[8:]
        except (asyncio.IncompleteReadError, ConnectionError):
            seen.closed_after = time.monotonic() - started

    pinging = asyncio.create_task(pinger())
    try:
        await asyncio.wait_for(watch(), seconds)
    except asyncio.TimeoutError:
        pass  # still open
    finally:
        pinging.cancel()
        writer.close()
    return seen


@pytest.mark.parametrize("transport_name", TRANSPORTS)
async def test_keepalive_drops_a_peer_that_never_answers_pings(
    transport_name: str, start_mock: StartServer
) -> None:
    _require(transport_name)
    config = ServerConfig(
        port=0, transport=transport_name, keepalive_time_ms=300, keepalive_timeout_ms=300
    )
    harness = await start_mock(config)
    seen = await _raw_peer(harness.server.port, ping_every=None, seconds=15)
    assert seen.pings >= 1 and seen.closed_after is not None and seen.closed_after < 10, seen


@pytest.mark.parametrize("transport_name", TRANSPORTS)
async def test_client_ping_policy_is_grpcios_alone(
    transport_name: str, start_mock: StartServer
) -> None:
    """grpcio sends GOAWAY (too_many_pings) to a client pinging faster than
    --min-client-ping-interval-ms allows; native does not police client pings (documented
    in --help and docs/operations.md), and this test says so if that changes."""
    _require(transport_name)
    harness = await start_mock(ServerConfig(port=0, transport=transport_name))
    seen = await _raw_peer(harness.server.port, ping_every=0.05, seconds=3)
    if transport_name == "grpcio":
        assert seen.goaway is not None and b"too_many_pings" in seen.goaway, seen
    else:
        assert seen.goaway is None and seen.closed_after is None, seen


# -- the mock-engine suite on native ---------------------------------------------------------------

# The behaviours to prove on native as on grpcio, by the files that prove them on grpcio.
NATIVE_SUITE = (
    # the three contracts (ours, vLLM's native, vLLM's official) and batches
    "test_generate.py",
    "test_native.py",
    "test_vllm_grpc.py",
    "test_generate_batch.py",
    # health (Check and Watch), drain, engine death; lifecycle of the CLI process
    "test_service.py",
    "test_cli.py",
    "test_engine_progress.py",
    # reflection and grpcurl
    "test_grpcurl.py",
    # cancel, deadline, Abort, dropped streams (also in the three contracts' files)
    "test_router_grade.py",
    "test_client.py",
    # API key (TLS and unix socket beside TCP: the refusal is asserted on native)
    "test_security.py",
    # the control key and --no-admin-rpcs: every control RPC, every credential
    "test_control_key.py",
    # admission and message-size limits, stalled readers, keepalive
    "test_limits.py",
    "test_bad_input.py",
    "test_keepalive.py",
    "test_stream_interval.py",
    "test_metrics.py",
    # both Rust routers in front of two workers: kill, restart, drain, a hung engine
    "test_e2e_router_faults.py",
    # the fuzzers and the cancel storm (CI scale)
    "test_fuzz.py",
    "test_native_fuzz.py",
    "stress/test_soak.py",
)
# Run in two pytest processes side by side: the suite mostly waits (health intervals, stall
# limits, a 15 s silent call; measured: 57 s of CPU in 160 s), so halves of about equal
# length (this file list from the router faults on, and the rest) end in about half the time.
_NATIVE_HALVES = (
    NATIVE_SUITE[: NATIVE_SUITE.index("test_e2e_router_faults.py")],
    NATIVE_SUITE[NATIVE_SUITE.index("test_e2e_router_faults.py") :],
)
_COUNT = re.compile(r"(\d+) (passed|failed|skipped|error|deselected|xfailed|xpassed)")
_SECTION = re.compile(r"^={5,} (.+?) ={5,}$", re.MULTILINE)


def _failures(output: str, limit: int = 12_000) -> str:
    """pytest's FAILURES and ERRORS sections (each test's traceback and captured log) and its
    short summary: what a failed run in CI must show, however long the figures after them."""
    heads = list(_SECTION.finditer(output))
    kept = [
        output[head.start() : after.start() if after else len(output)]
        for head, after in zip(heads, [*heads[1:], None], strict=True)
        if head.group(1) in ("FAILURES", "ERRORS", "short test summary info")
    ]
    text = "".join(kept)
    return text if len(text) <= limit else text[: limit // 2] + "\n[...]\n" + text[-limit // 2 :]


def _native_half(files: tuple[str, ...], folder: Path) -> subprocess.Popen[bytes]:
    """One half of the suite on native, in a pytest process of its own; its output goes to
    `folder`/out and `folder`/err (files: a pipe nobody reads yet would stall it)."""
    folder.mkdir()
    command = [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider",
               "-m", "not vllm"]  # fmt: skip
    with open(folder / "out", "wb") as out, open(folder / "err", "wb") as err:
        return subprocess.Popen(
            [*command, *(str(ROOT / "py_test" / name) for name in files)],
            cwd=ROOT,
            env={**os.environ, "VLLM_SERVICER_TRANSPORT": "native"},
            stdout=out,
            stderr=err,
        )


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_mock_engine_suite_passes_on_native(figures, tmp_path: Path) -> None:
    _require("native")
    started = time.monotonic()
    folders = [tmp_path / f"half-{i}" for i in range(len(_NATIVE_HALVES))]
    halves = [_native_half(f, folder) for f, folder in zip(_NATIVE_HALVES, folders, strict=True)]
    counts: dict[str, int] = {}
    try:
        for files, half, folder in zip(_NATIVE_HALVES, halves, folders, strict=True):
            half.wait(timeout=540 - (time.monotonic() - started))
            stdout = (folder / "out").read_text(errors="replace")
            stderr = (folder / "err").read_text(errors="replace")
            lines = stdout.strip().splitlines()
            summary = lines[-1] if lines else ""
            found = {kind: int(n) for n, kind in _COUNT.findall(summary)}  # "2 errors": error
            report = f"{files}:\n" + _failures(stdout) + "\n" + "\n".join(lines[-30:])
            assert half.returncode == 0, f"the suite on native failed:\n{report}\n{stderr[-2000:]}"
            assert found.get("failed", 0) == 0 and found.get("error", 0) == 0, report
            for kind, n in found.items():
                counts[kind] = counts.get(kind, 0) + n
    finally:
        for half in halves:
            half.kill()
    elapsed = time.monotonic() - started
    assert counts.get("passed", 0) > 150, counts
    figures(
        f"{len(NATIVE_SUITE)} files on --transport native in {elapsed:.0f}s (two halves side by "
        "side): " + ", ".join(f"{n} {kind}" for kind, n in sorted(counts.items()))
    )
