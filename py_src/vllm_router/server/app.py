"""Server lifecycle: listeners, services, health, signals, drain and shutdown order.

Order of events:
  engine built (by the caller) -> gRPC server started, health NOT_SERVING ->
  serving state checked -> SERVING -> ... -> SIGTERM -> NOT_SERVING, new
  generation RPCs UNAVAILABLE -> in-flight requests finish within the grace
  period, the rest are aborted -> server stopped -> engine shut down (its engine-core
  processes finish their own teardown) -> the process ends after its atexit handlers,
  without the interpreter's finalization (server/process_exit.py).
Engine death reaches the server through the serving state, from whichever path sees
it first (a failing stream or RPC, a health check, the poll): grpc.health.v1 reports
NOT_SERVING before that path answers its client, then the server drains and the
process exits non-zero so an orchestrator restarts the worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import ipaddress
import logging
import os
import signal
import socket
import time
from collections.abc import Iterator
from typing import TypeAlias

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from ..core import MediaRules, RequestTable, ServicerMetrics, ServingCore, ServingState
from ..core.lora_paths import LoraPathRule, PrefixError
from ..core.progress import ProgressWatchdog, StallLimits, silent_for
from ..defaults import CONTROL_API_KEY_ENV
from ..engine import AsyncEngine
from .config import ServerConfig, StartupError
from .health_service import LIVENESS, HealthService
from .interceptors import MalformedRequestInterceptor
from .metrics_http import MetricsEndpoint, start_metrics_endpoint
from .process_exit import end_after_atexit
from .registry import control_methods, enabled_contracts
from .security import caller_auth, check_keys, server_credentials
from .transport import build_server, check_transport, transport_sends

logger = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_ENGINE_DEAD = 1

HealthStatus: TypeAlias = health_pb2.HealthCheckResponse.ServingStatus.ValueType


class PortUnavailable(StartupError):
    """The listen address could not be bound (in use, or not a local address)."""


def address(host: str, port: int) -> str:
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


def preflight(config: ServerConfig) -> None:
    """Fail in milliseconds, before a model load that can take minutes."""
    check_keys(config)
    lora_path_rule(config)
    check_transport(config)
    problem = _stall_limits(config).check()
    if problem is not None:
        raise StartupError(problem)
    server_credentials(config.ssl_certfile, config.ssl_keyfile, config.ssl_ca_certs)
    if config.port > 0:
        _check_bindable(config.host, config.port)
    if config.metrics_port:
        _check_bindable(config.metrics_host or config.host, config.metrics_port)


def lora_path_rule(config: ServerConfig) -> LoraPathRule:
    try:
        return LoraPathRule.of(config.lora_allowed_path_prefixes, hub_ids=config.lora_hub_ids)
    except PrefixError as exc:
        raise StartupError(f"--lora-allowed-path-prefixes: {exc}") from None


def _stall_limits(config: ServerConfig) -> StallLimits:
    return StallLimits(config.engine_stall_timeout_seconds, config.engine_stall_exit_seconds)


def _check_bindable(host: str, port: int) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host.strip("[]"), port))
        except OSError as exc:
            raise PortUnavailable(
                f"cannot listen on {address(host, port)}: {exc.strerror}"
            ) from exc


@contextlib.contextmanager
def _owner_only_files() -> Iterator[None]:
    """Files created meanwhile (the unix socket) are never group/world accessible."""
    previous = os.umask(0o177)
    try:
        yield
    finally:
        os.umask(previous)


class RunningServer:
    """A started server around one engine; `run_until_shutdown` owns its life."""

    def __init__(self, engine: AsyncEngine, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        self.state = ServingState(engine)
        # Front-end series, recorded only when they are served (--metrics-port).
        self.metrics = ServicerMetrics() if config.metrics_port is not None else None
        self.metrics_endpoint: MetricsEndpoint | None = None
        self.requests = RequestTable(
            engine,
            self.state,
            max_concurrent=config.max_concurrent_streams,
            max_prompt_tokens=config.max_prompt_tokens,
            log_requests=config.enable_log_requests,
            metrics=self.metrics,
            media_rules=MediaRules.of(
                engine.facts,
                max_bytes=config.media_max_bytes,
                timeout=config.media_fetch_timeout_seconds,
            ),
        )
        self.watchdog = ProgressWatchdog(
            engine, self.state, self.requests, _stall_limits(config), self.metrics
        )
        if self.metrics is not None:
            self.metrics.watch(
                in_flight=lambda: len(self.requests.in_flight),
                draining=lambda: self.state.draining,
                engine_alive=lambda: not self.state.engine_dead,
                engine_silent=lambda: silent_for(engine),
                stall_stage=lambda: self.watchdog.stage,
            )
        self.core = ServingCore(
            engine,
            self.requests,
            self.state,
            self.metrics,
            transport_send=transport_sends(config),
            lora_paths=lora_path_rule(config),
        )
        self.state.on_change(self._refresh_health)
        self.health = HealthService()
        self.contracts = enabled_contracts(config)
        # Services answered by our own (core.handles_errors-decorated) servicers.
        self.services = tuple(entry.service_name for entry in self.contracts)
        interceptors: list[grpc.aio.ServerInterceptor] = [
            MalformedRequestInterceptor(self.services)
        ]
        refused = self.metrics.unauthenticated if self.metrics is not None else None
        auth = caller_auth(config, control_methods(self.contracts), on_refused=refused)
        if auth is not None:
            interceptors.insert(0, auth)
        self.server = build_server(config, interceptors)
        self.port = 0
        self.exit_code = EXIT_OK
        self._shutdown = asyncio.Event()
        self._abort_now = asyncio.Event()
        self._health_status: HealthStatus = health_pb2.HealthCheckResponse.NOT_SERVING
        self._served = False  # SERVING was published once (a later one is a return)
        self._background: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        for entry in self.contracts:
            entry.add_to_server(entry.servicer(self.core), self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (*self.services, health.SERVICE_NAME, reflection.SERVICE_NAME), self.server
        )
        await self._publish_health(self._health_status)
        await self.health.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)
        with _owner_only_files():
            self._listen()
            await self.server.start()
        await self._refresh_health()
        if self.metrics is not None and self.config.metrics_port is not None:
            self.metrics_endpoint = start_metrics_endpoint(
                self.metrics,
                self.engine,
                host=self.config.metrics_host or self.config.host,
                port=self.config.metrics_port,
            )
        self._background.append(asyncio.create_task(self._watch_health(), name="health"))
        if self.config.engine_stall_timeout_seconds > 0:
            watchdog = self.watchdog.run()
            self._background.append(asyncio.create_task(watchdog, name="engine-progress"))
        if self.config.stream_stall_timeout_seconds > 0:
            stall = self.requests.watch_stalled_streams(self.config.stream_stall_timeout_seconds)
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
        where = address(config.host, config.port)
        credentials = server_credentials(
            config.ssl_certfile, config.ssl_keyfile, config.ssl_ca_certs
        )
        try:
            if credentials is None:
                self.port = self.server.add_insecure_port(where)
            else:
                self.port = self.server.add_secure_port(where, credentials)
        except RuntimeError as exc:
            raise PortUnavailable(f"cannot listen on {where}: {exc}") from exc
        if self.port == 0:
            raise PortUnavailable(f"cannot listen on {where}: address in use or not local")

    # -- health -----------------------------------------------------------------------------------

    async def _refresh_health(self) -> None:
        """Publish the serving state to grpc.health.v1; on engine death, shut down non-zero."""
        status = await self.state.status()
        value = health_pb2.HealthCheckResponse
        published = value.SERVING if status.serving else value.NOT_SERVING
        if published != self._health_status:
            if not status.serving:
                logger.warning("Health: NOT_SERVING (%s)", status.reason)
            elif self._served:
                logger.warning("Health: SERVING again")
            self._served = self._served or status.serving
            await self._publish_health(published)
        if self.state.engine_dead and self.exit_code == EXIT_OK:
            logger.error("Engine is dead: reporting NOT_SERVING, draining, exiting non-zero")
            self.exit_code = EXIT_ENGINE_DEAD
            self.request_shutdown()

    async def _publish_health(self, value: HealthStatus) -> None:
        self._health_status = value
        for service in ("", *self.services):
            await self.health.set(service, value)

    async def _watch_health(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_poll_seconds)
            await self._refresh_health()

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
                len(self.requests.in_flight),
            )
        self.request_shutdown()

    async def run_until_shutdown(self) -> int:
        await self._shutdown.wait()
        await self.drain_and_stop()
        return self.exit_code

    async def drain_and_stop(self) -> None:
        self._shutdown.set()
        self.requests.start_draining()
        await self.health.enter_graceful_shutdown()
        if not await self._wait_idle_or_abort(self.config.shutdown_grace_seconds):
            left = len(self.requests.in_flight)
            logger.warning("Drain grace over: aborting %d request(s) still in flight", left)
            await self.requests.abort_all()
            await self.requests.wait_idle(5.0)
        # Health watchers hear NOT_SERVING, then their streams end with OK: a goodbye,
        # not the UNAVAILABLE the server's stop would give every call still open.
        await self.health.close_watches()
        await self.server.stop(grace=1.0)
        for task in self._background:
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        await self.engine.shutdown()
        if self.metrics_endpoint is not None:
            self.metrics_endpoint.close()
        if self.config.uds:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.config.uds)
        logger.info("Server stopped")

    async def _wait_idle_or_abort(self, grace: float) -> bool:
        idle = asyncio.ensure_future(self.requests.wait_idle(grace))
        abort = asyncio.ensure_future(self._abort_now.wait())
        try:
            await asyncio.wait({idle, abort}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            abort.cancel()
            idle.cancel()
        return idle.done() and not idle.cancelled() and idle.result()


def is_local_only(config: ServerConfig) -> bool:
    """Whether only this machine can connect: a unix socket alone, or a loopback address."""
    if config.port < 0:
        return True
    host = config.host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def warn_if_control_is_open(config: ServerConfig, port: int | None = None) -> None:
    """The RPCs that change the worker, served to anyone who reaches a non-local address
    (`port`: the one bound, when --port 0 picked it)."""
    if not config.admin_rpcs or config.control_api_key is not None or is_local_only(config):
        return
    guard = (
        "only the API key, which every router and client of this worker holds, guards them"
        if config.api_key is not None
        else "anyone who reaches the port can call them"
    )
    logger.warning(
        "RPCs that change this worker (LoRA loads, pause, sleep, weight updates, cache "
        "flushes) are served on %s without a control key: %s. Set --control-api-key "
        "(or $%s), or --no-admin-rpcs (docs/operations.md#threat-model)",
        address(config.host, config.port if port is None else port),
        guard,
        CONTROL_API_KEY_ENV,
    )


async def start_server(engine: AsyncEngine, config: ServerConfig) -> RunningServer:
    running = RunningServer(engine, config)
    await running.start()
    return running


def freeze_startup_heap() -> tuple[int, float]:
    """Takes every object alive now out of the garbage collector's full collections;
    returns how many and the seconds it took (one full collection first).

    The engine's start-up leaves hundreds of thousands of long-lived objects (vLLM's configs
    and validators, the tokenizer, torch's modules) that every full collection walks again,
    on the event loop, where no stream gets a token meanwhile; frozen, those collections are
    an order of magnitude shorter (the figures: benchmarks/results/stage-budget.md). vLLM's
    own servers freeze the same heap once started. Objects made later are collected as
    before; a frozen object that later ends in a garbage cycle is never freed, and start-up
    objects live as long as the process.
    """
    started = time.perf_counter()
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count(), time.perf_counter() - started


async def serve(engine: AsyncEngine, config: ServerConfig) -> int:
    """Serve `engine` until SIGTERM/SIGINT or engine death; returns the exit code."""
    frozen, took = freeze_startup_heap()
    logger.info("Start-up heap frozen: %d objects left out of collections (%.2fs)", frozen, took)
    running = await start_server(engine, config)
    running.install_signal_handlers()
    warn_if_control_is_open(config, running.port)
    facts = engine.facts
    where = [address(config.host, running.port)] if config.port >= 0 else []
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
    code = await running.run_until_shutdown()
    if code == EXIT_OK:
        # A clean, complete shutdown: what finalization would print is libraries' noise
        # (process_exit.py). An error path returns before this or exits non-zero, as before.
        end_after_atexit(code)
    return code
