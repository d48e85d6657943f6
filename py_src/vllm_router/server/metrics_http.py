"""The Prometheus endpoint: `/metrics` over plain HTTP, served by prometheus_client.

It runs in prometheus_client's own thread, so a scrape never waits on the event
loop that serves tokens (and a busy loop never delays a scrape).
"""

from __future__ import annotations

import logging
import threading
from wsgiref.simple_server import WSGIServer

from prometheus_client import start_http_server

from ..core import ServicerMetrics
from ..core.metrics import exposition_registry
from ..engine import AsyncEngine
from .config import StartupError

logger = logging.getLogger(__name__)


class MetricsEndpoint:
    """A started `/metrics` listener; `close()` stops it."""

    def __init__(self, server: WSGIServer, thread: threading.Thread, host: str) -> None:
        self._server = server
        self._thread = thread
        self.port: int = server.server_port
        display = f"[{host}]" if ":" in host else host
        self.url = f"http://{display}:{self.port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def start_metrics_endpoint(
    metrics: ServicerMetrics, engine: AsyncEngine, *, host: str, port: int
) -> MetricsEndpoint:
    """Serve our series and the engine's on http://host:port/metrics."""
    registry = exposition_registry(metrics.registry, engine.prometheus_registry())
    try:
        server, thread = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        raise StartupError(f"cannot serve metrics on {host}:{port}: {exc.strerror}") from exc
    endpoint = MetricsEndpoint(server, thread, host)
    logger.info("Prometheus metrics on %s", endpoint.url)
    return endpoint
