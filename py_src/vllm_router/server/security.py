"""Transport security and caller authentication: TLS / mutual TLS, a shared API key, and a
control key for the RPCs that change the worker (docs/operations.md#threat-model)."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc

from ..defaults import API_KEY_ENV, CONTROL_API_KEY_ENV
from .config import ServerConfig, StartupError
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


def _refusal(code: grpc.StatusCode, message: str) -> Callable[..., Awaitable[None]]:
    async def refuse(_request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(code, message)

    return refuse


_MISSING = _refusal(
    grpc.StatusCode.UNAUTHENTICATED,
    "missing or invalid credentials: send metadata 'authorization: Bearer <api key>'",
)


# The keys a server takes: (setting, what it is called in messages, its flag and variable).
KEYS = (
    ("api_key", "API key", f"--api-key or ${API_KEY_ENV}"),
    ("control_api_key", "control API key", f"--control-api-key or ${CONTROL_API_KEY_ENV}"),
)


def check_keys(config: ServerConfig) -> None:
    """Keys that cannot work are start-up errors: an empty one, from a flag or from a
    variable that is set but empty, must never read as "no key"; one with whitespace or a
    control character (a Secret file written with a trailing newline) could never be sent
    in a gRPC header; a control key equal to the API key guards nothing more."""
    for setting, what, where in KEYS:
        key = getattr(config, setting)
        if key == "":
            raise StartupError(f"the {what} must not be empty ({where})")
        if key is not None and any(c.isspace() or not c.isprintable() for c in key):
            raise StartupError(
                f"the {what} contains whitespace or a control character, which no gRPC "
                f"client can send ({where}; a trailing newline from a file?)"
            )
    if config.control_api_key is not None and config.control_api_key == config.api_key:
        raise StartupError(
            "the control API key must differ from the API key: every client holds the API key"
        )


def _bearer(key: str | None) -> bytes | None:
    return None if key is None else f"Bearer {key}".encode()


def caller_auth(
    config: ServerConfig,
    control_methods: frozenset[str],
    on_refused: Callable[[], None] | None = None,
) -> CallerAuth | None:
    """The interceptor `config` asks for (None: every RPC is open to every caller)."""
    check_keys(config)
    if config.api_key is None and config.control_api_key is None and config.admin_rpcs:
        return None
    return CallerAuth(
        api_key=config.api_key,
        control_api_key=config.control_api_key,
        control_methods=control_methods,
        admin_rpcs=config.admin_rpcs,
        on_refused=on_refused,
    )


class CallerAuth(grpc.aio.ServerInterceptor):
    """Who may call what, decided once per RPC before its handler runs.

    - grpc.health.v1 needs nothing (probes and load balancers carry no key).
    - A control RPC (one that changes the worker; each contract lists its own) needs the
      control key when one is set, else the API key when one is set; with `admin_rpcs`
      off it is refused (UNIMPLEMENTED) whatever is sent.
    - Every other RPC needs the API key, or the control key, when an API key is set.
    A missing or wrong key is UNAUTHENTICATED; the API key on a control RPC that needs the
    control key is PERMISSION_DENIED. A refused call never reaches its handler, so it
    changes nothing. Keys are compared in constant time and never logged or echoed.
    """

    def __init__(
        self,
        *,
        api_key: str | None,
        control_api_key: str | None,
        control_methods: frozenset[str],
        admin_rpcs: bool = True,
        on_refused: Callable[[], None] | None = None,
    ) -> None:
        if api_key == "" or control_api_key == "":
            raise StartupError("an API key must not be empty")
        self._api = _bearer(api_key)
        self._control = _bearer(control_api_key)
        self._control_methods = control_methods
        self._admin_rpcs = admin_rpcs
        self._on_refused = on_refused

    def _accepted(self, method: str) -> tuple[bytes, ...]:
        """The bearer values that open `method` (empty: open to every caller)."""
        if method in self._control_methods:
            if self._control is not None:
                return (self._control,)
            return () if self._api is None else (self._api,)
        if self._api is None:
            return ()
        return (self._api,) if self._control is None else (self._api, self._control)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        method = details.method
        if handler is None or method.startswith(UNAUTHENTICATED_PREFIXES):
            return handler
        control = method in self._control_methods
        if control and not self._admin_rpcs:
            return rebuild_handler(handler, behaviour=_not_served(method))
        accepted = self._accepted(method)
        if not accepted:
            return handler
        presented = b""
        for key, value in details.invocation_metadata or ():
            if key == "authorization":
                presented = value.encode() if isinstance(value, str) else value
                break
        # Every accepted key is compared (no early exit): the time says nothing of which.
        matches = [hmac.compare_digest(presented, expected) for expected in accepted]
        if any(matches):
            return handler
        if self._on_refused is not None:
            self._on_refused()
        if control and self._api is not None and hmac.compare_digest(presented, self._api):
            return rebuild_handler(handler, behaviour=_needs_control_key(method))
        if control and self._control is not None:
            return rebuild_handler(handler, behaviour=_missing_control_key(method))
        return rebuild_handler(handler, behaviour=_MISSING)


def _name(method: str) -> str:
    return method.lstrip("/")


def _not_served(method: str) -> Callable[..., Awaitable[None]]:
    return _refusal(
        grpc.StatusCode.UNIMPLEMENTED,
        f"{_name(method)} changes the worker, and this worker serves no such RPC "
        "(started with --no-admin-rpcs)",
    )


def _needs_control_key(method: str) -> Callable[..., Awaitable[None]]:
    return _refusal(
        grpc.StatusCode.PERMISSION_DENIED,
        f"{_name(method)} changes the worker: it needs the control key "
        "('authorization: Bearer <control api key>'), not the API key",
    )


def _missing_control_key(method: str) -> Callable[..., Awaitable[None]]:
    return _refusal(
        grpc.StatusCode.UNAUTHENTICATED,
        f"{_name(method)} changes the worker: send metadata "
        "'authorization: Bearer <control api key>'",
    )
