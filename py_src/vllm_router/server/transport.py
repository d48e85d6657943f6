"""The gRPC transport: which library speaks HTTP/2 for the same servicers (`--transport`).

`grpcio` (the default) is grpc.aio's own server. `native` is pygrpc-native's server (an
optional install: `pip install 'vllm-servicer[native]'`), a grpc.aio.Server subclass whose
HTTP/2 and gRPC framing run in Rust: the same servicers, interceptors, health (Watch too)
and reflection (its client-streaming methods go through a grpc.aio server it runs behind
itself on a private unix socket), for about a quarter less server CPU per streamed message.
It has no TLS and one listener, refuses some server options, and does not police client
pings. Everything native-specific lives here; pygrpc_native is imported only when chosen.

`check_transport` (called by preflight, and again when the server is built) refuses in one
line a configuration the chosen transport cannot honour: the worker never serves something
weaker than it was asked to.

Workaround of an upstream bug (pygrpc-native 0.5.0, `aio.Server._send`): a message the
client's flow-control window cannot take is handed to `stream_send` in a thread of the
event loop's default executor, which blocks until the client reads and stays blocked when
the RPC is cancelled (only the client's own cancel frees it). Six clients that stop reading
(the default executor's size on two cores) take every thread, and then every other stream
and every `asyncio.to_thread` hang. `_polling_send_server` replaces that one method: it
retries the non-blocking `stream_try_send` from the event loop (on every turn of the loop at
first, so a client that reads, only slower than the engine writes, loses no rate; then with
sleeps), so a stalled client costs a sleeping coroutine that any cancel (client, deadline,
the stall watchdog) ends, and the send buffer stays bounded per stream (STREAM_FULL). The
override is tied to the exact release and to the attributes it replaces or uses, checked
before use.

Direct sends (`transport_sends`, on unless --no-direct-sends): the serving core sends a
stream's plain steps, given direct from the engine's output loop (engine/direct.py,
core/flight.py), through `stream_try_send`, which never waits: a message the client's
window cannot take is refused and goes the awaited way above, merged with the steps after
it. Which steps go direct is engine/direct.py's rule; the transport only takes or refuses.
A stream's transport send looks up once what upstream's encoder looks up per message (the
call's serializer and id, the server's send limit): it runs once per token. The same
release-pinned touch points (the context's server and call, the call's handler and id, the
server's encoder and send limit) are checked with the rest.

A second upstream bug: `aio.Server.stop` closes the front as soon as the handlers have
returned, and `NativeGrpcFront.close` drops what its I/O threads have not written yet; a
stream's last message and its OK trailers are lost and the client reads UNAVAILABLE
("GOAWAY received") for a call that finished (measured: 32 of 180 health watches ended at
once, 70 of 180 on a loaded machine). So the override's `stop` waits, within the grace,
until the front's own call counts (its `metrics`, switched on for this) say every call whose
handler ended is finished on the wire, and only then lets upstream close it: a drain's last
answers and health watches' goodbyes arrive.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import inspect
import logging
import time
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import grpc

from ..core.flight import TransportSend
from .config import TRANSPORTS, ServerConfig, StartupError, server_options

logger = logging.getLogger(__name__)

GRPCIO, NATIVE = TRANSPORTS

NATIVE_DISTRIBUTION = "pygrpc-native"
# The one release whose private send path `_polling_send_server` replaces.
NATIVE_VERSION = "0.5.0"
NATIVE_INSTALL = "pip install 'vllm-servicer[native]'"

# Options pygrpc-native ignores without a word, left out so that what it is given is what
# it honours: it never sends GOAWAY for client pings (--help and the docs say so), and its
# keepalive timeout is the ping timeout already.
_IGNORED_BY_NATIVE = frozenset(
    {
        "grpc.http2.min_ping_interval_without_data_ms",
        "grpc.http2.max_ping_strikes",
        "grpc.http2.ping_timeout_ms",
    }
)
# pygrpc-native allows 1024 streams per connection unless told; grpc-core sets no limit,
# and a router multiplexes all of its requests over a few connections. Admission control
# is --max-concurrent-streams, in the serving core, on either transport.
NATIVE_MAX_STREAMS_PER_CONNECTION = 2**31 - 1

# How a send the transport cannot take yet is retried: STREAM_FULL says the client's window
# is full, or only that the stream's io thread has not yet taken the message before it
# (pygrpc-native 0.5.0 holds one message per stream between the handler and its io thread:
# a channel of capacity 1, read from its binary; test_transport.py's first-token test). A
# client that reads, only
# slower than the engine writes, frees room for the next message within a fraction of a
# millisecond, less than the shortest sleep the event loop can do (1 ms; sleeping that long
# per message cut such a stream to a quarter of its rate): the send first retries on every
# turn of the loop (other tasks run in between) for this long...
_SEND_SPIN_SECONDS = 0.0005
# ...then sleeps, 1 ms at first, doubling up to 20 ms: a stalled client costs ~50 wake-ups a
# second until the stall watchdog ends its stream.
_SEND_RETRY_FIRST_SECONDS = 0.001
_SEND_RETRY_MAX_SECONDS = 0.02
# A message right behind the same stream's previous one (two from one engine step: the
# native contract's prompt_info and first token, a last chunk and its `complete`, n > 1)
# is refused until the io thread has taken the first, which it does within tens of µs once
# it runs. Spinning on the event loop for it holds the CPU and the GIL that thread needs
# (measured with `bench.py --timeline`: the first token reached the client 1.7 ms after the
# handler yielded it, the prompt_info before it 0.9 ms). Such a send waits in short sleeps
# that let both go, blocking the loop for at most this long, then goes the way above.
_BEHIND_WITHIN_SECONDS = 0.0001  # "right behind": refused this soon after the last send
_BEHIND_WAIT_SECONDS = 0.0003
_BEHIND_SLEEP_SECONDS = 0.00002
# How often a stopping server asks the front whether the calls that ended are on the wire.
_WRITTEN_POLL_SECONDS = 0.002


def check_transport(config: ServerConfig) -> None:
    """Raise StartupError (one line) for an unknown transport or a setting it cannot honour
    (preflight: before the model loads)."""
    _check_settings(config)
    if config.transport == NATIVE:
        # Built and dropped: its constructor is where pygrpc-native refuses what it cannot do.
        _native_server(config, ())


def _check_settings(config: ServerConfig) -> None:
    if config.transport not in TRANSPORTS:
        raise StartupError(
            f"--transport {config.transport!r} is unknown: choose grpcio (the default) or native"
        )
    if config.transport == GRPCIO:
        return
    tls = [
        flag
        for flag, value in (
            ("--ssl-certfile", config.ssl_certfile),
            ("--ssl-keyfile", config.ssl_keyfile),
            ("--ssl-ca-certs", config.ssl_ca_certs),
        )
        if value
    ]
    if tls:
        raise StartupError(
            f"--transport native has no TLS ({' '.join(tls)}): serve TLS with --transport grpcio"
        )
    if config.uds and config.port >= 0:
        raise StartupError(
            "--transport native serves one listener: --uds needs --port -1 with it "
            "(--transport grpcio serves both)"
        )
    if config.min_client_ping_interval_ms is not None:
        raise StartupError(
            "--transport native does not police client pings (a client may ping as often as "
            "it likes): --min-client-ping-interval-ms cannot be honoured; drop it, or use "
            "--transport grpcio"
        )


def native_options(config: ServerConfig) -> list[tuple[str, int]]:
    """The channel arguments for pygrpc-native: ours, less those it ignores, plus its
    per-connection stream limit lifted to grpc-core's (none)."""
    options = [
        (key, value) for key, value in server_options(config) if key not in _IGNORED_BY_NATIVE
    ]
    return [*options, ("grpc.max_concurrent_streams", NATIVE_MAX_STREAMS_PER_CONNECTION)]


def build_server(
    config: ServerConfig, interceptors: Sequence[grpc.aio.ServerInterceptor]
) -> grpc.aio.Server:
    """The gRPC server `config.transport` names, with our options and `interceptors` (the
    settings checked again for in-process starts, which skip preflight; what the native
    constructor refuses it refuses here, without a throwaway server)."""
    _check_settings(config)
    if config.transport == NATIVE:
        logger.info(
            "Transport: native (%s %s; HTTP/2 in Rust; client keepalive pings are not limited)",
            NATIVE_DISTRIBUTION,
            NATIVE_VERSION,
        )
        return _native_server(config, interceptors)
    return grpc.aio.server(options=server_options(config), interceptors=interceptors)


def _native_server(
    config: ServerConfig, interceptors: Sequence[grpc.aio.ServerInterceptor]
) -> grpc.aio.Server:
    server_class = _polling_send_server(_native_module())
    try:
        server: grpc.aio.Server = server_class(
            interceptors=list(interceptors), options=native_options(config)
        )
    except (NotImplementedError, ValueError) as exc:
        raise StartupError(
            f"--transport native cannot serve this configuration ({exc}): use --transport grpcio"
        ) from exc
    return server


def _native_module() -> ModuleType:
    """pygrpc_native.aio, once its release and what the send override needs are checked."""
    try:
        package = importlib.import_module("pygrpc_native")
        aio = importlib.import_module("pygrpc_native.aio")
    except ImportError as exc:
        raise StartupError(
            f"--transport native needs {NATIVE_DISTRIBUTION}=={NATIVE_VERSION}, which is not "
            f"installed ({NATIVE_INSTALL}); or use --transport grpcio"
        ) from exc
    version = getattr(package, "__version__", "unknown")
    if version != NATIVE_VERSION:
        raise StartupError(
            f"--transport native needs {NATIVE_DISTRIBUTION}=={NATIVE_VERSION} exactly, not "
            f"{version}: this worker replaces that release's stream send path (a slow-reader "
            f"bug); install {NATIVE_VERSION} ({NATIVE_INSTALL}) or use --transport grpcio"
        )
    missing = _missing_touch_points(package, aio)
    if missing:
        raise StartupError(
            f"--transport native: {NATIVE_DISTRIBUTION} {version} lacks what this worker's "
            f"send override replaces or uses ({', '.join(missing)}); use --transport grpcio"
        )
    return aio


def _missing_touch_points(package: ModuleType, aio: ModuleType) -> list[str]:
    """What `_polling_send_server` and `transport_sends` rely on in pygrpc_native and do not
    find there."""
    server = getattr(aio, "Server", None)
    if not (isinstance(server, type) and issubclass(server, grpc.aio.Server)):
        return ["aio.Server, a grpc.aio.Server"]
    missing = []
    send = getattr(server, "_send", None)
    if not (
        inspect.iscoroutinefunction(send)
        and list(inspect.signature(send).parameters) == ["self", "call", "context", "response"]
    ):
        missing.append("async Server._send(self, call, context, response)")
    if not callable(getattr(server, "_encode", None)):
        missing.append("Server._encode")
    front = getattr(aio, "NativeGrpcFront", None)
    for name in ("stream_try_send", "metrics"):
        if not callable(getattr(front, name, None)):
            missing.append(f"NativeGrpcFront.{name}")
    # What the override's stop and transport_send read or set, stored by Server.__init__
    # (its calls and front, the send limit), and by _Call.__init__ (task, id, handler).
    server_init = getattr(getattr(server, "__init__", None), "__code__", None)
    for name in ("_front_args", "_front", "_calls", "_stopping", "_send_limit"):
        if name not in getattr(server_init, "co_names", ()):
            missing.append(f"Server.{name}")
    call_init = getattr(getattr(getattr(aio, "_Call", None), "__init__", None), "__code__", None)
    for name in ("task", "call_id", "handler"):
        if name not in getattr(call_init, "co_names", ()):
            missing.append(f"_Call.{name}")
    for name in ("STREAM_FULL", "STREAM_CLOSED"):
        if not isinstance(getattr(aio, name, None), int):
            missing.append(name)
    if not isinstance(getattr(package, "STREAM_SENT", None), int):
        missing.append("STREAM_SENT")
    # The context attribute the override sets, as upstream's _send does: its __init__
    # stores it (an attribute store names it in the code object's co_names).
    init = getattr(getattr(aio, "_Context", None), "__init__", None)
    stored = getattr(getattr(init, "__code__", None), "co_names", ())
    # ...and those a transport send reads (transport_sends).
    for name in ("_initial_sent", "_server", "_call", "_closed"):
        if name not in stored:
            missing.append(f"_Context.{name}")
    return missing


@functools.cache
def _polling_send_server(aio: ModuleType) -> type[grpc.aio.Server]:
    """pygrpc-native's server with a send that never blocks a thread (see the module doc)."""
    full, closed = aio.STREAM_FULL, aio.STREAM_CLOSED
    sent_now = importlib.import_module("pygrpc_native").STREAM_SENT
    base: Any = aio.Server  # a class known only once the optional package is imported

    class PollingSendServer(base):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            # Call counts, which say when an ended call is finished on the wire (`stop`).
            self._front_args["metrics"] = True
            # The call `_send` last sent a message of, and when (a message right behind it).
            self._last_call: Any = None
            self._last_sent_at = 0.0

        async def stop(self, grace: float | None) -> None:
            """Upstream's stop, after the handlers that end within `grace` are finished on
            the wire (see the module doc); what is still running then is cancelled, as
            upstream does at the end of the grace."""
            if grace and not self._stopping and self._front is not None:
                deadline = time.monotonic() + grace
                tasks = [call.task for call in self._calls.values() if call.task is not None]
                if tasks:
                    await asyncio.wait(tasks, timeout=grace)
                # Polled: the front signals nothing when it has written a call's end.
                while self._unwritten() and time.monotonic() < deadline:  # noqa: ASYNC110
                    await asyncio.sleep(_WRITTEN_POLL_SECONDS)
                grace = max(0.0, deadline - time.monotonic()) or None
            await super().stop(grace)

        def _unwritten(self) -> int:
            """Calls whose handler ended (or never ran) that the front has not finished."""
            counts = self._front.metrics()
            if counts is None:
                return 0
            methods = counts["methods"].values()
            started = sum(method["started"] for method in methods)
            finished = sum(s["count"] for method in methods for s in method["status"].values())
            running = sum(1 for call in self._calls.values() if call.task and not call.task.done())
            return max(0, started - finished - running)

        def try_send(self, call: Any, context: Any, response: Any) -> bool:
            """A send that never waits, the general way: True if the transport took
            `response` at once; False if the client's window is full or the stream has ended
            (or the message could not be encoded, which fails the call itself)."""
            if context._closed:
                return False
            data = self._encode(call, context, response)
            return data is not None and bool(
                self._front.stream_try_send(call.call_id, data) == sent_now
            )

        def transport_send(self, call: Any, context: Any) -> TransportSend:
            """A stream's send that never waits (`transport_sends`): what `try_send` does,
            with what it looks up per message looked up once, since it runs once per token
            and upstream's encoder is three calls deep (the saving is measured by
            benchmarks/direct_send.py). A message that is not plain bytes under the send
            limit, or whose encoding raises, goes `try_send`'s way, which fails the call as
            upstream does."""
            serializer = call.handler.response_serializer
            if serializer is None:
                return functools.partial(self.try_send, call, context)
            limit = self._send_limit if self._send_limit is not None else float("inf")
            try_send, call_id = self._front.stream_try_send, call.call_id
            general = self.try_send

            def send(response: Any) -> bool:
                if context._closed:
                    return False
                try:
                    data = serializer(response)
                except Exception:
                    return general(call, context, response)
                if type(data) is not bytes or len(data) > limit:
                    return general(call, context, response)
                return bool(try_send(call_id, data) == sent_now)

            return send

        async def _send(self, call: Any, context: Any, response: Any) -> bool:
            data = self._encode(call, context, response)
            if data is None:  # not encodable or over the send limit: the call was failed
                return False
            # No initial metadata after the first message (what upstream's _send records).
            context._initial_sent = True
            front, call_id = self._front, call.call_id
            sent = front.stream_try_send(call_id, data)
            if (
                sent == full
                and call_id == self._last_call
                and time.monotonic() - self._last_sent_at < _BEHIND_WITHIN_SECONDS
            ):
                until = time.monotonic() + _BEHIND_WAIT_SECONDS
                while sent == full and time.monotonic() < until:
                    time.sleep(_BEHIND_SLEEP_SECONDS)  # noqa: ASYNC251 (see the constants)
                    sent = front.stream_try_send(call_id, data)
            if sent == full:
                # The client's window is full, or the io thread has the message before this
                # one still. Waiting on the loop, not in a thread, is what
                # lets a cancel (the client's, a deadline, the stall watchdog) end the wait.
                spin_until = time.monotonic() + _SEND_SPIN_SECONDS
                delay = _SEND_RETRY_FIRST_SECONDS
                while sent == full:
                    if time.monotonic() < spin_until:
                        await asyncio.sleep(0)
                    else:
                        await asyncio.sleep(delay)
                        delay = min(2 * delay, _SEND_RETRY_MAX_SECONDS)
                    sent = front.stream_try_send(call_id, data)
            if sent == sent_now:
                self._last_call, self._last_sent_at = call_id, time.monotonic()
            return bool(sent != closed)

    return PollingSendServer


def transport_sends(
    config: ServerConfig,
) -> Callable[[grpc.aio.ServicerContext], TransportSend | None]:
    """What gives a stream's context its transport send (`ServingCore.transport_send`): on
    the native transport with direct sends on, for its own stream contexts; else none."""
    if config.transport != NATIVE or not config.direct_sends:
        return _no_transport_send
    context_class: type = _native_module()._Context

    def transport_send(context: grpc.aio.ServicerContext) -> TransportSend | None:
        if type(context) is not context_class:  # e.g. a reflection call on the fallback
            return None
        native: Any = context
        send: TransportSend = native._server.transport_send(native._call, native)
        return send

    return transport_send


def _no_transport_send(context: grpc.aio.ServicerContext) -> TransportSend | None:
    return None
