"""Worker lifecycle seen through the real router, on the mock engine (no model load):
SIGTERM drains streams the router is relaying; a dead engine is an error, never a hang."""

from __future__ import annotations

import asyncio
import json
import signal
import time
import urllib.request

import servers
from harness import require
from real_engine import tiny_model
from routers import openai_post, smg_path, smg_router_in_thread

CHAT = "/v1/chat/completions"


def _mock_worker_flags(model: str, *extra: str) -> list[str]:
    # The mock stands in for the tiny model: same name, vocabulary and context.
    return ["--mock-engine", "--port", "0", "--mock-model-name", model, "--mock-vocab-size",
            "512", "--mock-max-model-len", "256", "--mock-eos-token-id", "1", *extra]  # fmt: skip


def _body(model: str, max_tokens: int, **fields: object) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "Hello"}],
            "max_tokens": max_tokens, "ignore_eos": True, **fields}  # fmt: skip


def _stream_after_sigterm(base: str, body: dict, worker: servers.ServerProcess) -> list[dict]:
    """Stream through the router; SIGTERM the worker after the first chunks arrive."""
    request = urllib.request.Request(
        base + CHAT, data=json.dumps({**body, "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    events = []
    with urllib.request.urlopen(request, timeout=60) as response:
        for raw in response:
            line = raw.decode().strip()
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                events.append(json.loads(line[5:]))
                if len(events) == 3:
                    worker.process.send_signal(signal.SIGTERM)
    return events


async def test_sigterm_while_the_router_streams() -> None:
    require(smg_path() is not None, "smg is not installed (make test)")
    model = str(tiny_model())
    worker = await servers.start(*_mock_worker_flags(model, "--mock-step-delay", "0.02",
                                                     "--shutdown-grace-seconds", "30"))  # fmt: skip
    try:
        log = tiny_model().parent / "router-lc.log"
        async with smg_router_in_thread(
            [worker.address], tiny_model(), log,
            "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
        ) as base:  # fmt: skip
            events = await asyncio.to_thread(_stream_after_sigterm, base, _body(model, 120), worker)
            finish = [
                c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]
            ]
            assert finish == ["length"], events[-2:]  # the in-flight stream ran to its end
            assert await worker.wait(30) == 0
            started = time.monotonic()
            status, _ = await asyncio.to_thread(openai_post, base, CHAT, _body(model, 4))
            assert status >= 500 and time.monotonic() - started < 30, status
    finally:
        worker.kill()


async def test_engine_death_is_an_error_through_the_router() -> None:
    require(smg_path() is not None, "smg is not installed (make test)")
    model = str(tiny_model())
    worker = await servers.start(*_mock_worker_flags(model, "--mock-step-delay", "0.01",
                                                     "--mock-die-after-tokens", "20"))  # fmt: skip
    try:
        log = tiny_model().parent / "router-dead.log"
        async with smg_router_in_thread(
            [worker.address], tiny_model(), log, "--disable-retries"
        ) as base:
            started = time.monotonic()
            status, body = await asyncio.to_thread(openai_post, base, CHAT, _body(model, 100))
            assert status >= 500, (status, body)
            assert time.monotonic() - started < 15
            assert await worker.wait(30) == 1  # the worker exits non-zero to be restarted
    finally:
        worker.kill()
