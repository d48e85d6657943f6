"""Server lifecycle: options, health, reflection, signals, drain and shutdown order.

Order of events:
  engine built (by the caller) -> gRPC server started, health NOT_SERVING ->
  engine health checked -> SERVING -> ... -> SIGTERM -> NOT_SERVING, new
  generation RPCs UNAVAILABLE -> in-flight requests finish within the grace
  period, the rest are aborted -> server stopped -> engine shut down.
If the engine dies, health turns NOT_SERVING and the server drains and exits
non-zero so an orchestrator restarts the worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from .engine import AsyncEngine
from .errors import EngineUnavailable, MalformedRequestInterceptor
from .proto import vllm_engine_pb2_grpc as pb_grpc
from .security import ApiKeyInterceptor, server_credentials
from .vllm_servicer import SERVICE_NAME, VllmEngineServicer

logger = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_ENGINE_DEAD = 1


class PortUnavailable(RuntimeError):
    """The listen address could not be bound (in use, or not a local address)."""


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 50051
    shutdown_grace_seconds: float = 30.0
    max_message_bytes: int = 64 * 1024 * 1024
    # Server-initiated pings find dead peers; clients may ping as often as
    # every `min_client_ping_interval_ms` without being sent GOAWAY.
    keepalive_time_ms: int = 30_000
    keepalive_timeout_ms: int = 10_000
    min_client_ping_interval_ms: int = 500
    health_poll_seconds: float = 1.0
    log_requests: bool = False
    # Admission: generation requests in flight (0: no limit) and prompt length.
    max_concurrent_streams: int = 0
    max_prompt_tokens: int = 0
    # A stream whose client has not taken a message for this long is aborted (0: never).
    stream_stall_timeout_seconds: float = 60.0
    # Transport security; the unix socket (mode 0600) is always plaintext.
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_ca_certs: str | None = None
    api_key: str | None = field(default=None, repr=False)
    uds: str | None = None


def server_options(config: ServerConfig) -> list[tuple[str, int]]:
    """gRPC core channel arguments (real key names: unknown keys are ignored silently)."""
    return [
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.keepalive_time_ms", config.keepalive_time_ms),
        ("grpc.keepalive_timeout_ms", config.keepalive_timeout_ms),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", config.min_client_ping_interval_ms),
        ("grpc.http2.max_ping_strikes", 2),
        # Never let a second server bind the same port without an error.
        ("grpc.so_reuseport", 0),
    ]


def _address(host: str, port: int) -> str:
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


class RunningServer:
    """A started server around one engine; `run_until_shutdown` owns its life."""

    def __init__(self, engine: AsyncEngine, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        self.health = health.aio.HealthServicer()
        self.servicer = VllmEngineServicer(
            engine,
            on_engine_dead=self._engine_died,
            log_requests=config.log_requests,
            max_concurrent_streams=config.max_concurrent_streams,
            max_prompt_tokens=config.max_prompt_tokens,
        )
        interceptors: list[grpc.aio.ServerInterceptor] = [MalformedRequestInterceptor(SERVICE_NAME)]
        if config.api_key:
            interceptors.insert(0, ApiKeyInterceptor(config.api_key))
        self.server = grpc.aio.server(options=server_options(config), interceptors=interceptors)
        self.port = 0
        self.exit_code = EXIT_OK
        self._shutdown = asyncio.Event()
        self._abort_now = asyncio.Event()
        self._poke = asyncio.Event()
        self._health_status = health_pb2.HealthCheckResponse.NOT_SERVING
        self._background: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        pb_grpc.add_VllmEngineServicer_to_server(self.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self.server
        )
        self._listen()
        await self._set_health(self._health_status)
        await self.server.start()
        if self.config.uds:
            os.chmod(self.config.uds, 0o600)  # only this user (the co-located router)
        await self._refresh_health()
        self._background.append(asyncio.create_task(self._watch_engine(), name="engine-health"))
        if self.config.stream_stall_timeout_seconds > 0:
            stall = self.servicer.watch_stalled_streams(self.config.stream_stall_timeout_seconds)
            self._background.append(asyncio.create_task(stall, name="stalled-streams"))

    def _listen(self) -> None:
        config = self.config
        if config.uds:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(config.uds)  # a stale socket from an earlier run
            if self.server.add_insecure_port(f"unix:{config.uds}") == 0:
                raise PortUnavailable(f"cannot listen on unix:{config.uds}")
        if config.port < 0:
            if not config.uds:
                raise PortUnavailable("no listener: --port -1 needs --uds")
            return
        address = _address(config.host, config.port)
        credentials = server_credentials(
            config.ssl_certfile, config.ssl_keyfile, config.ssl_ca_certs
        )
        try:
            if credentials is None:
                self.port = self.server.add_insecure_port(address)
            else:
                self.port = self.server.add_secure_port(address, credentials)
        except RuntimeError as exc:
            raise PortUnavailable(f"cannot listen on {address}: {exc}") from exc
        if self.port == 0:
            raise PortUnavailable(f"cannot listen on {address}: address in use or not local")

    # -- health -----------------------------------------------------------------------------------

    async def _refresh_health(self) -> bool:
        try:
            await self.engine.check_health()
            healthy = True
        except EngineUnavailable:
            healthy = False
        status = health_pb2.HealthCheckResponse
        value = status.SERVING if healthy and not self.servicer.draining else status.NOT_SERVING
        if value != self._health_status:
            await self._set_health(value)
        return healthy

    async def _set_health(self, value: health_pb2.HealthCheckResponse.ServingStatus) -> None:
        self._health_status = value
        for service in ("", SERVICE_NAME):
            await self.health.set(service, value)

    async def _watch_engine(self) -> None:
        """Follow engine health until cancelled; a failed request pokes it at once."""
        while True:
            if not await self._refresh_health():
                self._engine_died()
            self._poke.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._poke.wait(), self.config.health_poll_seconds)

    def _engine_died(self) -> None:
        if self.exit_code == EXIT_OK:
            logger.error("Engine is dead: reporting NOT_SERVING, draining, exiting non-zero")
            self.exit_code = EXIT_ENGINE_DEAD
            self._poke.set()
            self.request_shutdown()

    # -- shutdown ---------------------------------------------------------------------------------

    def request_shutdown(self) -> None:
        """First call: drain gracefully. Second call: abort what is left at once."""
        if self._shutdown.is_set():
            self._abort_now.set()
        self._shutdown.set()

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)

    def _on_signal(self, sig: signal.Signals) -> None:
        if self._shutdown.is_set():
            logger.warning("%s again: aborting in-flight requests now", sig.name)
        else:
            logger.info(
                "%s: draining (grace %.1fs, %d requests in flight)",
                sig.name,
                self.config.shutdown_grace_seconds,
                len(self.servicer.in_flight),
            )
        self.request_shutdown()

    async def run_until_shutdown(self) -> int:
        await self._shutdown.wait()
        await self.drain_and_stop()
        return self.exit_code

    async def drain_and_stop(self) -> None:
        self._shutdown.set()
        self.servicer.start_draining()
        await self.health.enter_graceful_shutdown()
        if not await self._wait_idle_or_abort(self.config.shutdown_grace_seconds):
            left = len(self.servicer.in_flight)
            logger.warning("Drain grace over: aborting %d request(s) still in flight", left)
            await self.servicer.abort_all()
            await self.servicer.wait_idle(5.0)
        await self.server.stop(grace=1.0)
        for task in self._background:
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        await self.engine.shutdown()
        if self.config.uds:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.config.uds)
        logger.info("Server stopped")

    async def _wait_idle_or_abort(self, grace: float) -> bool:
        idle = asyncio.ensure_future(self.servicer.wait_idle(grace))
        abort = asyncio.ensure_future(self._abort_now.wait())
        try:
            await asyncio.wait({idle, abort}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            abort.cancel()
            idle.cancel()
        return idle.done() and not idle.cancelled() and idle.result()


async def start_server(engine: AsyncEngine, config: ServerConfig) -> RunningServer:
    running = RunningServer(engine, config)
    await running.start()
    return running


async def serve(engine: AsyncEngine, config: ServerConfig) -> int:
    """Serve `engine` until SIGTERM/SIGINT or engine death; returns the exit code."""
    running = await start_server(engine, config)
    running.install_signal_handlers()
    facts = engine.facts
    where = [_address(config.host, running.port)] if config.port >= 0 else []
    if config.uds:
        where.append(f"unix:{config.uds}")
    logger.info(
        "vllm-servicer ready on %s%s (engine %s %s, model %s, max_model_len %d)",
        " and ".join(where),
        " with TLS" if config.ssl_certfile else "",
        facts.engine,
        facts.engine_version,
        facts.served_model_name,
        facts.max_model_len,
    )
    return await running.run_until_shutdown()
