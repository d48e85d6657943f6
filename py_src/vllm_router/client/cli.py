"""`vllm-servicer-client`: poke a worker from a shell, a probe or a deploy script.

Exit codes: 0 success (and SERVING for `health`), 1 any failure (one line on stderr,
never a traceback), 2 bad usage. `--json` prints one machine-readable object.
"""

# A call should cost about what its RPC costs: modules are imported where a command needs
# them (gRPC once a command runs, not for --help; the tokenizer only for text prompts).
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from ..defaults import API_KEY_ENV, CONTROL_API_KEY_ENV, DEFAULT_ADDRESS

if TYPE_CHECKING:
    from .worker import WorkerClient

Command = Callable[["WorkerClient", argparse.Namespace], Coroutine[Any, Any, int]]


def _emit(args: argparse.Namespace, data: dict[str, Any], lines: list[str]) -> None:
    if args.json:
        print(json.dumps(data, indent=None if args.command == "generate" else 2))
    else:
        print("\n".join(lines))


def _as_dict(message: Any) -> dict[str, Any]:
    from google.protobuf.json_format import MessageToDict

    return MessageToDict(message, preserving_proto_field_name=True)


async def info(worker: WorkerClient, args: argparse.Namespace) -> int:
    reply = await worker.model_info()
    data = _as_dict(reply)
    _emit(args, data, [f"{key}: {value}" for key, value in data.items()])
    return 0


async def health(worker: WorkerClient, args: argparse.Namespace) -> int:
    serving = await worker.health(args.service)
    status = "SERVING" if serving else "NOT_SERVING"
    _emit(args, {"status": status}, [status])
    return 0 if serving else 1


async def loads(worker: WorkerClient, args: argparse.Namespace) -> int:
    reply = await worker.loads()
    lines = [
        f"rank {r.dp_rank}: {r.running_requests} running, {r.waiting_requests} waiting, "
        f"KV cache {r.kv_cache_usage_percent:.1f}% (at {r.measured_at.ToJsonString()})"
        if r.HasField("measured_at")
        else f"rank {r.dp_rank}: not reported yet (figures unknown)"
        for r in reply.ranks
    ]
    lines.append(f"requests in flight on this worker: {reply.requests_in_flight}")
    _emit(args, _as_dict(reply), lines)
    return 0


async def abort(worker: WorkerClient, args: argparse.Namespace) -> int:
    aborted = await worker.abort(*args.request_ids)
    line = f"aborted: {' '.join(aborted)}" if aborted else "none of these requests was in flight"
    _emit(args, {"aborted_request_ids": aborted}, [line])
    return 0


def _sampling(args: argparse.Namespace) -> dict[str, Any]:
    sampling: dict[str, Any] = {"max_tokens": args.max_tokens}
    for name in ("temperature", "top_p", "seed"):
        if getattr(args, name) is not None:
            sampling[name] = getattr(args, name)
    if args.stop:
        sampling["stop"] = args.stop
    if args.ignore_eos:
        sampling["ignore_eos"] = True
    return sampling


async def generate(worker: WorkerClient, args: argparse.Namespace) -> int:
    prompt: str | list[int] = args.prompt
    if args.token_ids:
        prompt = [int(token) for token in args.prompt.replace(",", " ").split()]
    # Tokenizing (and rendering a chat) is not the worker's time.
    if args.chat:
        prompt = await worker.chat_prompt([{"role": "user", "content": args.prompt}])
    else:
        prompt = await worker.encode_prompt(prompt)
    started = time.perf_counter()
    first: float | None = None
    text: list[str] = []
    ids: list[int] = []
    last: Any = None
    async for message in worker.stream(prompt, request_id=args.request_id, **_sampling(args)):
        if first is None:
            first = time.perf_counter()
        if not args.json:
            print(message.text_delta, end="", flush=True)
        text.append(message.text_delta)
        ids.extend(message.token_ids)
        last = message
    elapsed = time.perf_counter() - started
    ttft_ms = ((first or started) - started) * 1000
    decode_s = elapsed - ttft_ms / 1000
    rate = (len(ids) - 1) / decode_s if len(ids) > 1 and decode_s > 0 else 0.0
    usage = last.usage if last is not None else None
    data = {
        "request_id": last.request_id if last is not None else "",
        "text": "".join(text),
        "token_ids": ids,
        "finish_reason": last.finish_reason if last is not None else "",
        "prompt_tokens": usage.prompt_tokens if usage else 0,
        "completion_tokens": usage.completion_tokens if usage else 0,
        "ttft_ms": round(ttft_ms, 2),
        "tokens_per_s": round(rate, 1),
    }
    if args.json:
        _emit(args, data, [])
    else:
        print()
        print(
            f"[{data['finish_reason']}] prompt {data['prompt_tokens']} + completion "
            f"{data['completion_tokens']} tokens · TTFT {ttft_ms:.1f} ms · {rate:.1f} tokens/s",
            file=sys.stderr,
        )
    return 0


async def run_bench(worker: WorkerClient, args: argparse.Namespace) -> int:
    from .bench import run as run_load
    from .bench import summary_rows

    progress = None
    if not args.json:
        from tqdm import tqdm

        progress = tqdm(total=args.requests, unit="req", file=sys.stderr, leave=False)
    try:
        summary = await run_load(
            worker,
            requests=args.requests,
            concurrency=args.concurrency,
            prompt_tokens=args.prompt_tokens,
            max_tokens=args.max_tokens,
            stream_interval=args.stream_interval,
            batched=args.batched,
            progress=progress,
        )
    finally:
        if progress is not None:
            progress.close()
    rows = summary_rows(summary)
    width = max(len(name) for name, _ in rows)
    _emit(args, summary, [f"{name.ljust(width)}  {value}" for name, value in rows])
    return 0 if summary["failed"] == 0 else 1


def _connection_options(target: argparse.ArgumentParser, *, defaults: bool) -> None:
    """Where and how to connect, and the output form. Accepted before the command (with the
    defaults) and after it (`health --address HOST:PORT`, as probes are written), where
    only an option given there overrides."""

    def default(value: Any) -> Any:
        return value if defaults else argparse.SUPPRESS

    where = target.add_mutually_exclusive_group()
    where.add_argument(
        "--address", default=default(DEFAULT_ADDRESS), help="HOST:PORT of the worker"
    )
    where.add_argument("--uds", default=default(None), help="the worker's unix socket instead")
    target.add_argument(
        "--api-key",
        default=default(os.environ.get(API_KEY_ENV)),
        help=f"sent as 'authorization: Bearer' (default: ${API_KEY_ENV})",
    )
    target.add_argument(
        "--control-api-key",
        default=default(os.environ.get(CONTROL_API_KEY_ENV)),
        help="sent as 'authorization: Bearer' with calls that change the worker, and with "
        f"every call when no API key is given (default: ${CONTROL_API_KEY_ENV})",
    )
    target.add_argument(
        "--tls",
        action="store_true",
        default=default(False),
        help="connect with TLS (system trust store)",
    )
    target.add_argument(
        "--ca-certs", default=default(None), help="trust this CA bundle (implies --tls)"
    )
    target.add_argument(
        "--certfile", default=default(None), help="client certificate for mTLS (implies --tls)"
    )
    target.add_argument("--keyfile", default=default(None), help="client key for mTLS")
    target.add_argument(
        "--tls-server-name", default=default(None), help="the name the worker's certificate carries"
    )
    target.add_argument(
        "--timeout", type=float, default=default(10.0), help="seconds, for non-generation calls"
    )
    target.add_argument(
        "--json", action="store_true", default=default(False), help="one JSON object on stdout"
    )


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="vllm-servicer-client", description=__doc__)
    _connection_options(top, defaults=True)
    subparsers = top.add_subparsers(dest="command", required=True)

    def command(name: str, help: str) -> argparse.ArgumentParser:
        sub = subparsers.add_parser(name, help=help)
        _connection_options(sub, defaults=False)
        return sub

    command("info", "model and engine facts (GetModelInfo)")
    probe = command("health", "grpc.health.v1: exit 0 when SERVING, else 1")
    probe.add_argument("--service", default="", help="a service name ('' = the whole server)")
    command("loads", "per-rank scheduler load (GetLoads)")
    gen = command("generate", "stream a completion of PROMPT to the terminal")
    gen.add_argument("prompt", help="text (tokenized with the worker's tokenizer) or, with "
                                    "--token-ids, ids like '1,2,3'")  # fmt: skip
    form = gen.add_mutually_exclusive_group()
    form.add_argument("--token-ids", action="store_true", help="PROMPT is token ids")
    form.add_argument(
        "--chat",
        action="store_true",
        help="PROMPT is a user message, rendered with the model's chat template",
    )
    gen.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate")
    gen.add_argument(
        "--temperature", type=float, help="sampling temperature (default: the model's)"
    )
    gen.add_argument("--top-p", type=float, help="nucleus sampling (default: the model's)")
    gen.add_argument("--seed", type=int, help="a seed for reproducible sampling")
    gen.add_argument("--stop", action="append", help="a stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true", help="go on past the EOS token")
    gen.add_argument(
        "--request-id", default="", help="the request's id (default: the worker makes one)"
    )
    stop = command("abort", "abort requests in flight by id")
    stop.add_argument("request_ids", nargs="+", help="ids of requests in flight")
    load = command("bench", "N streams at concurrency C, then a summary")
    load.add_argument("-n", "--requests", type=int, default=64, help="streams in all")
    load.add_argument("-c", "--concurrency", type=int, default=8, help="streams at once")
    load.add_argument("--prompt-tokens", type=int, default=32, help="prompt length")
    load.add_argument("--max-tokens", type=int, default=64, help="tokens per stream")
    load.add_argument("--stream-interval", type=int, default=1, help="a message every N tokens")
    load.add_argument(
        "--batched",
        action="store_true",
        help="every request on one GenerateBatch stream (as a router multiplexes them)",
    )
    return top


COMMANDS: dict[str, Command] = {
    "info": info,
    "health": health,
    "loads": loads,
    "generate": generate,
    "abort": abort,
    "bench": run_bench,
}


async def _run(args: argparse.Namespace) -> int:
    from .worker import Tls, WorkerClient

    tls = None
    if args.tls or args.ca_certs or args.certfile:
        tls = Tls(args.ca_certs, args.certfile, args.keyfile, args.tls_server_name)
    async with WorkerClient(
        args.address,
        uds=args.uds,
        api_key=args.api_key,
        control_api_key=args.control_api_key,
        tls=tls,
        timeout=args.timeout,
    ) as worker:
        return await COMMANDS[args.command](worker, args)


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)  # --help and bad usage exit here, before any import below
    import asyncio

    from .errors import WorkerError

    try:
        code = asyncio.run(_run(args))
    except WorkerError as exc:
        where = f"unix:{args.uds}" if args.uds else args.address
        detail = exc.details.splitlines()[0] if exc.details else ""
        print(f"vllm-servicer-client: {where}: {exc.code.name}: {detail}", file=sys.stderr)
        code = 1
    # Unreadable TLS files, bad token ids, a chat template that refuses the chat, a
    # tokenizer that needs transformers where it is not installed.
    except (OSError, ValueError, ImportError) as exc:
        print(f"vllm-servicer-client: {exc}", file=sys.stderr)
        code = 1
    except KeyboardInterrupt:
        code = 130
    sys.exit(code)


if __name__ == "__main__":
    main()
