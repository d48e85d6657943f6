"""The gRPC server: configuration, listeners, interceptors, security and lifecycle."""

from .app import (
    EXIT_ENGINE_DEAD,
    EXIT_OK,
    PortUnavailable,
    RunningServer,
    preflight,
    serve,
    start_server,
)
from .config import ServerConfig, StartupError, server_options

__all__ = [
    "EXIT_ENGINE_DEAD",
    "EXIT_OK",
    "PortUnavailable",
    "RunningServer",
    "ServerConfig",
    "StartupError",
    "preflight",
    "serve",
    "server_options",
    "start_server",
]
