"""`vllm-servicer-client` as an operator runs it: a subprocess against a worker.

Every failure is one line on stderr and exit 1, never a traceback. A call imports only
what its command needs (no transformers, torch, vLLM or numpy at all).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from vllm_router.server import ServerConfig
from vllm_router.testing.mock_config import MockConfig
from vllm_router.testing.mock_tokenizer import MockEngineWithTokenizer, write_word_tokenizer

from harness import Harness, StartServer, read_rest, request, start_harness

CLIENT = [sys.executable, "-c", "from vllm_router.client_cli import main; main()"]
# The same, writing the top-level modules it imported to $MODULES_FILE as it exits.
LISTING_CLIENT = [sys.executable, "-c", "import atexit, json, os, sys; atexit.register(lambda: "
                  "open(os.environ['MODULES_FILE'], 'w').write(json.dumps(sorted("
                  "{m.split('.')[0] for m in sys.modules})))); "
                  "from vllm_router.client_cli import main; main()"]  # fmt: skip
# What a thin client must never pay for: seconds of imports each.
HEAVY = {"transformers", "torch", "vllm", "numpy"}


async def client(
    *args: str, timeout: float = 120, modules: Path | None = None
) -> tuple[int, str, str]:
    """Run the CLI (in its own process: this event loop keeps serving meanwhile);
    `modules`: a file the CLI lists its imported modules in."""
    listing = {"MODULES_FILE": str(modules)} if modules else {}
    process = await asyncio.create_subprocess_exec(
        *(LISTING_CLIENT if modules else CLIENT), *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "VLLM_SERVICER_API_KEY": "", **listing},
    )  # fmt: skip
    out, err = await asyncio.wait_for(process.communicate(), timeout)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


def one_clear_line(rc: int, err: str, *expected: str) -> None:
    assert rc == 1
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("vllm-servicer-client: ")
    for text in expected:
        assert text in lines[0], lines[0]


async def test_connection_options_work_after_the_command_too(mock: Harness) -> None:
    """Probes are written `health --address HOST:PORT`, as grpc-health-probe and kubectl go."""
    rc, out, err = await client("health", "--address", mock.address)
    assert (rc, out.strip()) == (0, "SERVING"), err
    rc, out, _ = await client("info", "--json", "--address", mock.address, "--timeout", "5")
    assert rc == 0 and json.loads(out)["served_model_name"] == "mock-model"
    # Given in both places, the one after the command wins.
    rc, out, _ = await client("--address", "127.0.0.1:1", "health", "--address", mock.address)
    assert (rc, out.strip()) == (0, "SERVING")
    rc, _, err = await client("--address", mock.address, "health", "--address", "127.0.0.1:1")
    one_clear_line(rc, err, "127.0.0.1:1", "UNAVAILABLE")


async def test_commands_against_the_mock(mock: Harness) -> None:
    at = ("--address", mock.address)
    rc, out, _ = await client(*at, "info")
    assert rc == 0 and "engine: mock" in out and "max_model_len: 4096" in out
    rc, out, _ = await client(*at, "--json", "info")
    assert rc == 0 and json.loads(out)["served_model_name"] == "mock-model"
    rc, out, _ = await client(*at, "health")
    assert (rc, out.strip()) == (0, "SERVING")
    rc, out, _ = await client(*at, "loads")
    assert rc == 0 and out.startswith("rank 0: 0 running, 0 waiting")
    rc, out, err = await client(*at, "generate", "10 11", "--token-ids", "--max-tokens", "3",
                                "--ignore-eos")  # fmt: skip
    assert rc == 0 and out.split() == ["12", "13", "14"]
    assert err.startswith("[length] prompt 2 + completion 3 tokens · TTFT ")
    rc, out, _ = await client(*at, "--json", "generate", "hi", "--max-tokens", "2")
    answer = json.loads(out)
    assert answer["completion_tokens"] == 2 and answer["prompt_tokens"] == 2
    assert answer["finish_reason"] == "length" and len(answer["token_ids"]) == 2
    rc, out, _ = await client(*at, "--json", "abort", "nobody")
    assert (rc, json.loads(out)) == (0, {"aborted_request_ids": []})
    rc, out, err = await client(*at, "bench", "-n", "12", "-c", "4", "--max-tokens", "5")
    assert rc == 0 and "12 ok, 0 failed (concurrency 4)" in out and "TTFT p50 / p99" in out
    rc, out, _ = await client(*at, "--json", "bench", "-n", "6", "-c", "3", "--max-tokens", "4")
    summary = json.loads(out)
    assert (summary["succeeded"], summary["output_tokens"]) == (6, 24)
    batched = ("--json", "bench", "--batched", "-n", "8", "-c", "4", "--max-tokens", "4")
    rc, out, _ = await client(*at, *batched)
    summary = json.loads(out)
    assert (rc, summary["succeeded"], summary["output_tokens"]) == (0, 8, 32)


async def test_abort_of_a_running_request(mock: Harness) -> None:
    stream = mock.stub.GenerateStream(
        request([5], request_id="long", max_tokens=3000, ignore_eos=True)
    )
    await stream.read()
    rc, out, _ = await client("--address", mock.address, "abort", "long")
    assert (rc, out.strip()) == (0, "aborted: long")
    last = (await read_rest(stream))[-1]
    assert last.finish_reason == "abort"


async def test_health_is_a_probe(start_mock: StartServer) -> None:
    harness = await start_mock(ServerConfig(port=0, api_key="k", health_poll_seconds=0.05))
    rc, out, _ = await client("--address", harness.address, "health")  # no key needed
    assert (rc, out.strip()) == (0, "SERVING")
    harness.server.requests.start_draining()
    rc, out = await health_after_watcher(harness.address, "--json")
    assert (rc, json.loads(out)) == (1, {"status": "NOT_SERVING"})


async def health_after_watcher(address: str, *args: str) -> tuple[int, str]:
    """`health`, once the server's health watcher (polling every 50 ms) has seen the change."""
    await asyncio.sleep(0.2)
    rc, out, _ = await client("--address", address, *args, "health")
    return rc, out


async def test_failures_are_one_line(start_mock: StartServer, pki: dict) -> None:
    rc, _, err = await client("--address", "127.0.0.1:1", "info")
    one_clear_line(rc, err, "127.0.0.1:1: UNAVAILABLE", "Connection refused")
    plain = await start_mock(ServerConfig(port=0, api_key="right", health_poll_seconds=0.05))
    rc, _, err = await client("--address", plain.address, "--tls", "info")
    one_clear_line(rc, err, "UNAVAILABLE", "handshake")
    rc, _, err = await client("--address", plain.address, "--api-key", "wrong", "info")
    one_clear_line(rc, err, "UNAUTHENTICATED", "authorization: Bearer")
    tls = await start_mock(
        ServerConfig(
            port=0,
            ssl_certfile=str(pki["server_cert_path"]),
            ssl_keyfile=str(pki["server_key_path"]),
        )
    )
    rc, _, err = await client("--address", tls.address, "info")
    one_clear_line(rc, err, "UNAVAILABLE")
    secure = ("--address", f"localhost:{tls.server.port}", "--ca-certs", str(pki["ca_path"]))
    rc, out, _ = await client(*secure, "health")
    assert (rc, out.strip()) == (0, "SERVING")
    rc, _, err = await client(*secure[:2], "--ca-certs", "/nonexistent.pem", "info")
    one_clear_line(rc, err, "/nonexistent.pem")
    plain.engine.kill()
    rc, _, err = await client("--address", plain.address, "--api-key", "right", "generate", "x")
    one_clear_line(rc, err, "UNAVAILABLE", "engine is dead")
    rc, out = await health_after_watcher(plain.address)
    assert (rc, out.strip()) == (1, "NOT_SERVING")


async def test_unix_socket(start_mock: StartServer, tmp_path: Path) -> None:
    uds = str(tmp_path / "worker.sock")
    await start_mock(ServerConfig(port=-1, uds=uds))
    rc, out, _ = await client("--uds", uds, "generate", "1 2", "--token-ids", "--max-tokens",
                              "2", "--ignore-eos")  # fmt: skip
    assert rc == 0 and out.split() == ["3", "4"]


@pytest_asyncio.fixture
async def tokenizing_worker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[str]:
    """The address of a mock worker serving a word tokenizer's files (ids stated in
    testing.mock_tokenizer); the CLI calls share a fresh tokenizer cache."""
    monkeypatch.setenv("VLLM_SERVICER_TOKENIZER_CACHE", str(tmp_path / "cache"))
    engine = MockEngineWithTokenizer(write_word_tokenizer(tmp_path / "words"), MockConfig())
    harness = await start_harness(engine, ServerConfig(port=0, shutdown_grace_seconds=2.0))
    try:
        yield harness.address
    finally:
        await harness.close()


async def test_text_and_chat_prompts_with_the_workers_tokenizer(tokenizing_worker: str) -> None:
    """Tokenized on the client (the mock would count a text's bytes): `<s>hello world` and
    the chat template's `<s>user: hello world\\n<s>assistant:`."""
    generate = ("--address", tokenizing_worker, "--json", "generate", "--max-tokens", "2",
                "--ignore-eos")  # fmt: skip
    rc, out, err = await client(*generate, "hello world")
    assert rc == 0, err
    answer = json.loads(out)
    assert (answer["prompt_tokens"], answer["token_ids"]) == (3, [9, 10])
    rc, out, err = await client(*generate, "--chat", "hello world")
    assert rc == 0, err
    answer = json.loads(out)
    assert (answer["prompt_tokens"], answer["token_ids"]) == (8, [7, 8])


async def test_each_command_imports_only_what_it_needs(
    tokenizing_worker: str, tmp_path: Path
) -> None:
    at = ("--address", tokenizing_worker)
    one = ("--max-tokens", "1")
    # (arguments, modules it must not import, modules it must)
    cases = [
        (("--help",), {"grpc", "google", "asyncio", "tokenizers", "jinja2"}, set()),
        ((*at, "info"), {"tokenizers", "jinja2", "tqdm"}, {"grpc"}),
        ((*at, "health"), {"tokenizers", "jinja2", "tqdm"}, {"grpc"}),
        ((*at, "loads"), {"tokenizers", "jinja2", "tqdm"}, {"grpc"}),
        ((*at, "generate", "1 2", "--token-ids", *one), {"tokenizers", "jinja2"}, {"grpc"}),
        ((*at, "generate", "hello", *one), {"jinja2"}, {"tokenizers"}),
        ((*at, "generate", "--chat", "hello", *one), set(), {"tokenizers", "jinja2"}),
    ]
    listing = tmp_path / "modules.json"
    for args, absent, present in cases:
        rc, _, err = await client(*args, modules=listing)
        assert rc == 0, err
        imported = set(json.loads(listing.read_text()))
        assert not imported & (absent | HEAVY), (args, imported & (absent | HEAVY))
        assert present <= imported, (args, present - imported)


@pytest.mark.vllm
async def test_generate_text_on_the_real_engine(real: Harness, tmp_path: Path) -> None:
    rc, out, _ = await client("--address", real.address, "--json", "generate",
                              "Good servers drain", "--max-tokens", "6", "--seed", "5")  # fmt: skip
    assert rc == 0
    answer = json.loads(out)
    from vllm_router.proto import vllm_engine_pb2 as pb

    server_side = await real.stub.Generate(
        pb.GenerateRequest(
            prompt_text="Good servers drain",
            sampling_params=pb.SamplingParams(max_tokens=6, seed=5),
        )
    )
    assert answer["token_ids"] == list(server_side.output_token_ids)
    assert answer["text"] == server_side.output_text
    assert answer["prompt_tokens"] == server_side.usage.prompt_tokens
    rc, out, _ = await client("--address", real.address, "loads")
    assert rc == 0 and out.startswith("rank 0: ")
