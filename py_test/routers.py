"""The real Rust router (SMG) and vLLM's own `--grpc` server as subprocesses, for e2e tests,
and OpenAI requests through a router reduced to what a client relies on (for comparisons)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

from vllm_router.testing.wait_serving import serving

from harness import Harness, tool_path
from real_engine import ROOT, cli_flags
from vllm_servers import START_TIMEOUT, free_port, stop_process_group

ROUTER_VENV = ROOT / ".venv-router"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def smg_path() -> str | None:
    return tool_path("smg", ROUTER_VENV / "bin")


@contextlib.contextmanager
def _running(
    command: list[str],
    log: Path,
    ready: Callable[[], bool],
    what: str,
    env: dict[str, str] | None = None,
) -> Iterator[subprocess.Popen]:
    """Run `command` (output to `log`) until the block ends; enter once `ready()` holds."""
    with open(log, "w") as out:
        process = subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
        try:
            deadline = time.monotonic() + START_TIMEOUT
            while not ready():
                if process.poll() is not None:
                    raise AssertionError(f"{what} exited with {process.returncode}: see {log}")
                if time.monotonic() > deadline:
                    raise AssertionError(f"{what} not ready in {START_TIMEOUT} s: see {log}")
                time.sleep(0.5)
            yield process
        finally:
            stop_process_group(process)


def _http_models_ready(base: str) -> bool:
    try:
        with urllib.request.urlopen(base + "/v1/models", timeout=2) as response:
            return response.status == 200 and b'"data":[{' in response.read()
    except OSError:
        return False


def _tokenizer_loaded(log: Path) -> bool:
    text = log.read_text(errors="replace")
    return "Successfully registered tokenizer" in text or "Successfully loaded tokenizer" in text


@contextlib.contextmanager
def vllm_grpc_server(
    model: Path, engine_flags: dict[str, object], log: Path, env: dict[str, str] | None = None
) -> Iterator[str]:
    """vLLM's own gRPC launcher (what `vllm serve --grpc` runs); yields its address."""
    port = free_port()
    launcher = "vllm.entrypoints.launchers.grpc_server"
    command = [sys.executable, "-m", launcher, "--model", str(model), "--host", "127.0.0.1",
               "--port", str(port), *cli_flags(engine_flags)]  # fmt: skip
    address = f"127.0.0.1:{port}"
    # Its planned warm-up (~35k prompt tokens before SERVING) changes no output; off, it
    # starts in seconds instead of minutes on a real model on these CPUs.
    env = {"SMG_VLLM_SERVICER_WARMUP": "off", **(env or {})}
    with _running(command, log, lambda: serving(address), "vLLM's gRPC server", env):
        yield address


@contextlib.contextmanager
def smg_router(workers: list[str], model: Path, log: Path, *extra: str) -> Iterator[str]:
    """`smg launch` in front of gRPC workers; yields the router's HTTP base URL. With no
    `workers`, `extra` names them (e.g. --pd-disaggregation --prefill ... --decode ...)."""
    binary = smg_path()
    assert binary is not None, "the smg router is not installed (make test installs it)"
    port, metrics_port = free_port(), free_port()
    command = [binary, "launch", "--host", "127.0.0.1", "--port", str(port),
               *(["--worker-urls", *(f"grpc://{w}" for w in workers)] if workers else []),
               "--model-path", str(model),
               "--backend", "vllm", "--prometheus-host", "127.0.0.1",
               "--prometheus-port", str(metrics_port), *extra]  # fmt: skip
    base = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        # It lists the model before its tokenizer has loaded (in the background): until
        # then chat answers 503 tokenizer_not_ready.
        return _http_models_ready(base) and _tokenizer_loaded(log)

    with _running(command, log, ready, "the smg router"):
        yield base


class Launch:
    """A server's context (a router, vLLM's own servers), entered in a thread from the
    moment the launch is made and left in one: this event loop keeps running meanwhile, so
    in-process workers (and subprocess pipes read by this loop) are served, and other
    servers or an in-process engine can start at the same time. Servers that a module needs
    together are launched together: their start-ups (each mostly one core's work for 20-30 s)
    overlap on the machine's cores instead of following one another."""

    def __init__(self, started: contextlib.AbstractContextManager[str]) -> None:
        self._stack = contextlib.ExitStack()
        self._entering = asyncio.ensure_future(
            asyncio.to_thread(self._stack.enter_context, started)
        )

    async def ready(self) -> str:
        """The server's address once it is ready; its start's error if it failed. A caller
        that leaves does not stop the start (the thread runs on: `close` waits for it)."""
        return await asyncio.shield(self._entering)

    async def close(self) -> None:
        """Leave the context, once its start has ended either way."""
        await asyncio.wait([self._entering])
        if not self._entering.cancelled():
            self._entering.exception()  # retrieved: a failed start is reported by `ready`
        await asyncio.to_thread(self._stack.close)


@contextlib.asynccontextmanager
async def launched(
    **started: contextlib.AbstractContextManager[str],
) -> AsyncIterator[dict[str, Launch]]:
    """Each of `started` launched at once (see `Launch`), all left together at the end."""
    launches = {name: Launch(context) for name, context in started.items()}
    try:
        yield launches
    finally:
        await asyncio.gather(*(launch.close() for launch in launches.values()))


@contextlib.asynccontextmanager
async def in_thread(started: contextlib.AbstractContextManager[str]) -> AsyncIterator[str]:
    """One server's context, entered and left in a thread (see `Launch`), once it is ready."""
    launch = Launch(started)
    try:
        yield await launch.ready()
    finally:
        await launch.close()


def smg_router_in_thread(
    workers: list[str], model: Path, log: Path, *extra: str
) -> contextlib.AbstractAsyncContextManager[str]:
    """`smg_router`, started and stopped in a thread (see `in_thread`)."""
    return in_thread(smg_router(workers, model, log, *extra))


# A client that reads a streamed chat's first lines and hangs up, in a process of its own so
# that its reads never wait for this process's GIL (which the in-process worker holds).
_DROPPING_CLIENT = """
import http.client, sys
host, port, path, body = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
connection = http.client.HTTPConnection(host, port, timeout=30)
connection.request("POST", path, body, {"Content-Type": "application/json"})
response = connection.getresponse()
for _ in range(4):
    response.readline()
connection.close()
print(response.status, flush=True)
"""


class Dropped(NamedTuple):
    generated: int  # tokens the worker generated for the request in all
    at_hang_up: int  # ...of which before the client had hung up (sampled once it exited)


async def drop_mid_stream(base: str, body: dict, harness: Harness, attempts: int = 3) -> Dropped:
    """Stream a chat through the router to `harness`'s worker, read its first lines and hang
    up, checking the request was in flight on the worker meanwhile; wait for the engine to
    stop, check it stopped short (under half the answer after the hang-up) and say how many
    tokens the worker generated for it, and how many of them before the hang-up. A starved
    client can hang up only after the tiny model has produced most of the answer, which then
    says nothing of the hang-up: that round is run again."""
    metrics = harness.server.metrics
    assert metrics is not None, "the harness records no metrics (metrics_port)"
    asked = body["max_tokens"]
    url = urllib.parse.urlparse(base)

    def generated() -> float:
        value = metrics.registry.get_sample_value("vllm_servicer:generated_tokens_total")
        return value or 0.0

    for _ in range(attempts):
        assert not harness.server.requests.in_flight, "the worker is not idle"
        seen_in_flight = False

        async def watch() -> None:
            nonlocal seen_in_flight
            while not seen_in_flight:
                seen_in_flight = bool(harness.server.requests.in_flight)
                await asyncio.sleep(0.001)

        before = generated()
        watcher = asyncio.create_task(watch())
        client = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _DROPPING_CLIENT, str(url.hostname), str(url.port), CHAT,
            json.dumps(body), stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        try:
            out, _ = await asyncio.wait_for(client.communicate(), 60)
        finally:
            watcher.cancel()
        at_hang_up = int(generated() - before)
        assert out.decode().strip() == "200", out
        assert seen_in_flight, "the request was never in flight on the worker"
        deadline = time.monotonic() + 10
        while harness.engine.load().running_requests or harness.server.requests.in_flight:
            assert time.monotonic() < deadline, "the worker did not stop the request"
            await asyncio.sleep(0.02)
        dropped = Dropped(int(generated() - before), at_hang_up)
        if at_hang_up < asked // 2:
            # The hang-up reached the engine, which did not run the request out.
            assert dropped.generated - at_hang_up < asked // 2, dropped
            assert dropped.generated < asked, dropped
            return dropped
    raise AssertionError(f"in {attempts} rounds the client hung up only late: {dropped}")


def openai_post(base: str, path: str, body: dict) -> tuple[int, dict]:
    """POST to the router; (HTTP status, JSON body) whatever the status."""
    request = urllib.request.Request(
        base + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        raw = exc.read() or b"{}"
        try:
            return exc.code, json.loads(raw)
        except json.JSONDecodeError:  # vllm-router answers some errors in plain text
            return exc.code, {"error": {"message": raw.decode(errors="replace")}}


def openai_stream(base: str, path: str, body: dict) -> list[dict]:
    """POST a streaming request; the JSON of every `data:` event before [DONE]."""
    request = urllib.request.Request(
        base + path,
        data=json.dumps({**body, "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
    )
    events = []
    with urllib.request.urlopen(request, timeout=300) as response:
        for raw in response:
            line = raw.decode().strip()
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                events.append(json.loads(line[5:]))
    return events


def chat(content: str, **fields: Any) -> dict:
    """A chat body with one user message."""
    return {"messages": [{"role": "user", "content": content}], **fields}


def _without_ids(tool_calls: list[dict] | None) -> list[dict] | None:
    """Tool calls without their ids: the router draws a random `call_...` id for each."""
    if tool_calls is None:
        return None
    return [{key: value for key, value in call.items() if key != "id"} for call in tool_calls]


def normalized(path: str, status: int, body: dict) -> Any:
    """What a client relies on: status, per-choice output and finish reason, usage, logprobs."""
    if status != 200:
        error = body.get("error")
        error = error if isinstance(error, dict) else {}
        return status, error.get("type"), error.get("code")
    choices = []
    for choice in sorted(body["choices"], key=lambda c: c["index"]):
        message = choice.get("message") or {}
        choices.append(
            (
                choice["index"],
                message.get("content") if path == CHAT else choice.get("text"),
                json.dumps(_without_ids(message.get("tool_calls")), sort_keys=True)
                if message
                else None,
                choice["finish_reason"],
                json.dumps(choice.get("logprobs"), sort_keys=True),
            )
        )
    usage = body.get("usage") or {}
    return status, choices, (usage.get("prompt_tokens"), usage.get("completion_tokens"))


def joined(path: str, events: list[dict]) -> Any:
    """A streamed answer as what a client assembles: text and finish reason per choice."""
    text: dict[int, str] = {}
    finish: dict[int, str | None] = {}
    usage = None
    for event in events:
        usage = event.get("usage") or usage
        for choice in event.get("choices", []):
            piece = (
                (choice.get("delta") or {}).get("content") if path == CHAT else choice.get("text")
            )
            text[choice["index"]] = text.get(choice["index"], "") + (piece or "")
            finish[choice["index"]] = choice.get("finish_reason") or finish.get(choice["index"])
    counts = (usage.get("prompt_tokens"), usage.get("completion_tokens")) if usage else None
    return sorted(text.items()), sorted(finish.items()), counts


async def ask(base: str, path: str, body: dict, streamed: bool) -> Any:
    if streamed:
        body = {**body, "stream_options": {"include_usage": True}}
        return joined(path, await asyncio.to_thread(openai_stream, base, path, body))
    status, answer = await asyncio.to_thread(openai_post, base, path, body)
    return normalized(path, status, answer)
