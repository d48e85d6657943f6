"""ServerConfig: every server setting declared once; the CLI derives `--<name>` flags from it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..core.lora_paths import PREFIXES_ENV as LORA_PREFIXES_ENV
from ..core.media_admission import DEFAULT_MAX_BYTES as DEFAULT_MEDIA_MAX_BYTES
from ..core.media_admission import DEFAULT_TIMEOUT as DEFAULT_MEDIA_TIMEOUT
from ..core.progress import DEFAULT_EXIT_SECONDS as DEFAULT_ENGINE_STALL_EXIT
from ..core.progress import DEFAULT_TIMEOUT_SECONDS as DEFAULT_ENGINE_STALL_TIMEOUT
from ..defaults import (
    API_KEY_ENV,
    CONTROL_API_KEY_ENV,
    DEFAULT_HOST,
    DEFAULT_MAX_MESSAGE_BYTES,
    DEFAULT_PORT,
    WEIGHT_FILE_ROOT_ENV,
)

# Field metadata keys read by `vllm_router.dataclass_flags`.
HELP = "help"
ENV = "env"  # environment variable that supplies the default
VLLM_DEFINES = "vllm_defines"  # vLLM's engine flags define this flag when vLLM is present
# How the vLLM engine is served: a flag only when vLLM is installed (not for --mock-engine).
VLLM_ONLY = "vllm_only"
METAVAR = "metavar"  # the value's placeholder in --help
ENV_SEPARATOR = "env_separator"  # what separates a several-valued setting's items in its variable
CHOICES = "choices"  # the only values the flag accepts
# The transports `transport` may name (server/transport.py builds each); grpcio the default.
TRANSPORTS = ("grpcio", "native")
# How often a client may keepalive-ping on grpcio without a GOAWAY (too_many_pings).
DEFAULT_MIN_CLIENT_PING_INTERVAL_MS = 500


class StartupError(RuntimeError):
    """The server cannot start with this configuration (reported in one line, exit 1)."""


def _opt(default: Any, help: str, **extra: Any) -> Any:
    return field(default=default, metadata={HELP: help, **extra})


@dataclass(frozen=True)
class ServerConfig:
    host: str = _opt(DEFAULT_HOST, "address to listen on (0.0.0.0: all)")
    vllm_grpc: bool = _opt(
        True,
        "also serve vLLM's official contract vllm.grpc.engine.VllmEngine (what `vllm serve "
        "--grpc` serves and the SMG router speaks) on the same port",
    )
    vllm_native: bool = _opt(
        True,
        "also serve vLLM's native contract vllm.Inference + vllm.Control (what vllm-rs "
        "--grpc-port serves and vllm-router speaks) on the same port",
    )
    port: int = _opt(
        DEFAULT_PORT, "TCP port; 0 picks a free port and logs it; -1: none (needs --uds)"
    )
    # Which library speaks HTTP/2 for the same servicers (server/transport.py). grpcio is the
    # default: pygrpc-native has no TLS, one listener, and does not police client pings.
    transport: str = _opt(
        TRANSPORTS[0],
        "the gRPC transport: grpcio (grpc.aio; every feature) or native (opt-in, needs "
        "pygrpc-native: HTTP/2 in Rust, less CPU per streamed message; no TLS, one listener "
        "(TCP or --uds), does not police client pings); a setting native "
        "cannot honour is a start-up error",
        **{CHOICES: TRANSPORTS},
    )
    direct_sends: bool = _opt(
        True,
        "with --transport native, send a stream's plain steps (new tokens only) directly "
        "from the engine's output loop without waking the request's task (steps merge only "
        "while the transport cannot take them); --no-direct-sends sends every message "
        "from the handler",
    )
    shutdown_grace_seconds: float = _opt(
        30.0, "on SIGTERM/SIGINT, how long in-flight requests may run before they are aborted"
    )
    max_message_bytes: int = _opt(
        DEFAULT_MAX_MESSAGE_BYTES,
        "largest request or response message; larger get RESOURCE_EXHAUSTED",
    )
    # Server-initiated pings find dead peers; clients may ping as often as
    # every `min_client_ping_interval_ms` without being sent GOAWAY (grpcio alone polices
    # client pings: None is the transport's own rule, DEFAULT_MIN_CLIENT_PING_INTERVAL_MS on
    # grpcio, none on native, which refuses the setting).
    keepalive_time_ms: int = _opt(30_000, "ping a connection this often to find dead peers")
    keepalive_timeout_ms: int = _opt(10_000, "drop a connection whose ping is not answered in time")
    min_client_ping_interval_ms: int | None = _opt(
        None,
        "clients may send keepalive pings this often without being disconnected (default "
        f"{DEFAULT_MIN_CLIENT_PING_INTERVAL_MS}; --transport grpcio only: native does not "
        "police client pings and refuses this setting)",
    )
    health_poll_seconds: float = _opt(1.0, "how often grpc.health.v1 re-checks the engine")
    enable_log_requests: bool = _opt(
        False, "log each request's id and prompt length (never its tokens)", **{VLLM_DEFINES: True}
    )
    # Admission: generation requests in flight (0: no limit) and prompt length.
    max_concurrent_streams: int = _opt(
        0,
        "generation requests in flight at most; more get RESOURCE_EXHAUSTED at once "
        "(0: no limit, the engine queues them)",
    )
    max_prompt_tokens: int = _opt(
        0, "longest prompt admitted, in tokens (0: only the model's context limits it)"
    )
    # Media URLs (http(s) hosts and the local directory are vLLM's --allowed-media-domains
    # and --allowed-local-media-path; see core.media_admission).
    media_max_bytes: int = _opt(
        DEFAULT_MEDIA_MAX_BYTES,
        "largest image (or other media item) a request may name by URL (items sent inline are "
        "bounded by --max-message-bytes)",
    )
    media_fetch_timeout_seconds: float = _opt(
        DEFAULT_MEDIA_TIMEOUT, "longest fetch of one media URL; slower is UNAVAILABLE"
    )
    stream_stall_timeout_seconds: float = _opt(
        60.0, "abort a stream whose client has not read a message for this long (0: never)"
    )
    engine_stall_timeout_seconds: float = _opt(
        DEFAULT_ENGINE_STALL_TIMEOUT,
        "with requests running, an engine that makes no step for this long is stalled: the "
        "worker leaves rotation (NOT_SERVING, new requests refused, streams in flight kept) "
        "until its next step (0: no stall watchdog)",
    )
    engine_stall_exit_seconds: float = _opt(
        DEFAULT_ENGINE_STALL_EXIT,
        "with requests running, an engine that makes no step for this long is stuck: its "
        "requests fail UNAVAILABLE and the worker exits non-zero (longer than "
        "--engine-stall-timeout-seconds; 0: never)",
    )
    # Transport security; the unix socket (mode 0600) is always plaintext.
    ssl_certfile: str | None = _opt(None, "server certificate (PEM): serve TLS")
    ssl_keyfile: str | None = _opt(None, "server private key (PEM)")
    ssl_ca_certs: str | None = _opt(
        None, "CA bundle (PEM): require client certificates signed by it (mTLS)"
    )
    api_key: str | None = field(
        default=None,
        repr=False,
        metadata={
            HELP: "require 'authorization: Bearer <key>' on every RPC but grpc.health.v1",
            ENV: API_KEY_ENV,
        },
    )
    # Who may change the worker (server/security.py; docs/operations.md#threat-model).
    control_api_key: str | None = field(
        default=None,
        repr=False,
        metadata={
            HELP: "require 'authorization: Bearer <key>' with this key on every RPC that "
            "changes the worker or reads its control state (LoRA loads, pause, sleep, weight "
            "updates, cache flushes, profiling; each contract's list is in docs/operations.md); "
            "it also passes the --api-key check. Unset: those RPCs need what every RPC needs",
            ENV: CONTROL_API_KEY_ENV,
        },
    )
    admin_rpcs: bool = _opt(
        True,
        "serve the RPCs that change the worker (see --control-api-key); --no-admin-rpcs "
        "refuses every one of them with UNIMPLEMENTED, whatever key the caller sends",
    )
    metrics_port: int | None = _opt(
        None,
        "serve Prometheus metrics (vllm_servicer:* and vLLM's vllm:* series) over HTTP on "
        "this port at /metrics (0: a free port, logged; default: off)",
    )
    metrics_host: str | None = _opt(None, "address of the metrics listener (default: --host)")
    uds: str | None = _opt(
        None, "also listen on this unix socket (mode 0600, plaintext); --port -1 for it alone"
    )
    # How the vLLM engine is served (the mock engine has neither).
    lean_outputs: bool = _opt(
        True,
        "stream a request that asks for one sample and no logprobs without building "
        "vLLM's RequestOutput per step (same tokens, text, stop handling and vllm: "
        "metrics; less CPU per token); --no-lean-outputs sends every request through "
        "AsyncLLM.generate",
        **{VLLM_ONLY: True},
    )
    direct_entry: bool = _opt(
        True,
        "hand a token-id request to vLLM's engine core with the calls AsyncLLM.add_request "
        "makes for it, without its general work (same validation, admission and request; "
        "less CPU per request); --no-direct-entry sends every request through add_request",
        **{VLLM_ONLY: True},
    )
    lora_allowed_path_prefixes: tuple[str, ...] | None = _opt(
        None,
        "directories a LoRA adapter loaded at run time (LoadLora, LoadLoraAdapter) may come "
        "from, once links and '..' are resolved; none: every local path is refused, as "
        f"vllm-rs refuses it (from ${LORA_PREFIXES_ENV}, ':'-separated, as vllm-rs reads it)",
        **{ENV: LORA_PREFIXES_ENV, ENV_SEPARATOR: ":", METAVAR: "DIR"},
    )
    lora_hub_ids: bool = _opt(
        True,
        "load a LoRA adapter named by a model hub id at run time (vLLM downloads it), as "
        "vllm-rs does; --no-lora-hub-ids refuses them",
    )
    weight_file_root: str | None = _opt(
        None,
        "the directory the `file` weight-transfer backend may read beneath (weights a "
        "trainer names in UpdateWeights); passed to vLLM's processes as "
        f"${WEIGHT_FILE_ROOT_ENV}. Unset: that backend refuses every update",
        **{VLLM_ONLY: True, ENV: WEIGHT_FILE_ROOT_ENV, METAVAR: "DIR"},
    )
    lora_modules: tuple[str, ...] | None = _opt(
        None,
        "LoRA adapters to load at start (needs --enable-lora), as vLLM's OpenAI server",
        **{VLLM_ONLY: True, METAVAR: "NAME=PATH"},
    )


def min_client_ping_interval_ms(config: ServerConfig) -> int:
    """How often a client may ping on grpcio (the setting, or its default)."""
    interval = config.min_client_ping_interval_ms
    return DEFAULT_MIN_CLIENT_PING_INTERVAL_MS if interval is None else interval


def server_options(config: ServerConfig) -> list[tuple[str, int]]:
    """gRPC core channel arguments (real key names: unknown keys are ignored silently)."""
    return [
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.keepalive_time_ms", config.keepalive_time_ms),
        ("grpc.keepalive_timeout_ms", config.keepalive_timeout_ms),
        # grpc-core waits for a ping's ack this long (default 60 s), whatever the keepalive
        # timeout says: without it a dead peer is found a minute late (measured on 1.85).
        ("grpc.http2.ping_timeout_ms", config.keepalive_timeout_ms),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", min_client_ping_interval_ms(config)),
        ("grpc.http2.max_ping_strikes", 2),
        # Never let a second server bind the same port without an error.
        ("grpc.so_reuseport", 0),
    ]
