"""Transport security and caller authentication: TLS / mutual TLS and a shared bearer token."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc

from .config import StartupError
from .interceptors import rebuild_handler

# Kubernetes probes and load balancers must reach health without a token.
UNAUTHENTICATED_PREFIXES = ("/grpc.health.v1.Health/",)


def server_credentials(
    certfile: str | None, keyfile: str | None, ca_certs: str | None
) -> grpc.ServerCredentials | None:
    """TLS credentials; with `ca_certs`, clients must present a certificate signed by it."""
    if not certfile and not keyfile:
        if ca_certs:
            raise StartupError("--ssl-ca-certs needs --ssl-certfile and --ssl-keyfile")
        return None
    if not (certfile and keyfile):
        raise StartupError("TLS needs both --ssl-certfile and --ssl-keyfile")
    try:
        key = Path(keyfile).read_bytes()
        cert = Path(certfile).read_bytes()
        root = Path(ca_certs).read_bytes() if ca_certs else None
    except OSError as exc:
        raise StartupError(f"cannot read a TLS file: {exc}") from exc
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=root, require_client_auth=root is not None
    )


async def _refuse(_request: Any, context: grpc.aio.ServicerContext) -> None:
    await context.abort(
        grpc.StatusCode.UNAUTHENTICATED,
        "missing or invalid credentials: send metadata 'authorization: Bearer <api key>'",
    )


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Every RPC but grpc.health.v1 needs `authorization: Bearer <key>` (constant-time check)."""

    def __init__(self, api_key: str, on_refused: Callable[[], None] | None = None) -> None:
        if not api_key:
            raise StartupError("the API key must not be empty (--api-key)")
        self._expected = f"Bearer {api_key}".encode()
        self._on_refused = on_refused

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or details.method.startswith(UNAUTHENTICATED_PREFIXES):
            return handler
        presented = b""
        for key, value in details.invocation_metadata or ():
            if key == "authorization":
                presented = value.encode() if isinstance(value, str) else value
                break
        if hmac.compare_digest(presented, self._expected):
            return handler
        if self._on_refused is not None:
            self._on_refused()
        return rebuild_handler(handler, behaviour=_refuse)
