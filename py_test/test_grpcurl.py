"""A non-Python client (grpcurl, Go's gRPC stack) runs the docs' commands via reflection.

The README and docs/contracts.md each have a "## Try it with grpcurl" section; its bash
blocks are run exactly as printed (only the address and the LoRA path are substituted).
"""

from __future__ import annotations

import asyncio
import json
import re
import shlex
import signal
from pathlib import Path

import pytest

from vllm_router.contracts.vllm_engine_v1.servicer import VllmEngineServicer
from vllm_router.proto import vllm_engine_pb2 as pb

import servers
from harness import Harness, grpcurl_path, require
from real_engine import CONTROL_KEY, tiny_lora

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
CONTRACTS = ROOT / "docs" / "contracts.md"


def grpcurl_commands(doc: Path, block_index: int = 0) -> list[list[str]]:
    """The grpcurl lines of the `block_index`-th bash block in `doc`'s grpcurl section."""
    text = doc.read_text()
    assert "\n## Try it with grpcurl\n" in text, f"{doc.name} lost its grpcurl section"
    section = text.split("\n## Try it with grpcurl\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    assert len(blocks) > block_index, f"{doc.name} lost its grpcurl examples"
    return [
        shlex.split(line)
        for line in blocks[block_index].splitlines()
        if line.startswith("grpcurl ")
    ]


def _json_messages(output: str) -> list[dict]:
    return [json.loads(chunk) for chunk in re.split(r"(?<=\})\n(?=\{)", output.strip())]


async def _grpcurl(binary: str, args: list[str]) -> tuple[int | None, str, str]:
    process = await asyncio.create_subprocess_exec(
        binary, *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(process.communicate(), 30)
    return process.returncode, out.decode(), err.decode()


async def test_docs_grpcurl_commands_work_as_printed() -> None:
    binary = grpcurl_path()
    require(binary is not None, "grpcurl is not installed (make install puts it in .venv/bin)")
    assert binary is not None
    readme = grpcurl_commands(README)
    assert {"vllm.engine.v1.VllmEngine/GenerateStream", "vllm.Inference/GenerateStream"} <= {
        cmd[-1] for cmd in readme
    }
    commands = readme + grpcurl_commands(CONTRACTS)
    called = {cmd[-1] for cmd in commands}
    for rpc in (
        "GenerateStream",
        "Generate",
        "GetModelInfo",
        "HealthCheck",
        "ResetPrefixCache",
    ):
        assert f"vllm.engine.v1.VllmEngine/{rpc}" in called
    for rpc in ("Generate", "HealthCheck"):
        assert f"vllm.grpc.engine.VllmEngine/{rpc}" in called
    assert "grpc.health.v1.Health/Check" in called

    server = await servers.start("--mock-engine", "--port", "0")
    try:
        outputs = {}
        for command in commands:
            args = [server.address if a == "localhost:50051" else a for a in command[1:]]
            code, out, err = await _grpcurl(binary, args)
            assert code == 0, (command, err)
            outputs[command[-1]] = out
        assert "vllm.engine.v1.VllmEngine" in outputs["list"]
        unary = json.loads(outputs["vllm.engine.v1.VllmEngine/Generate"])
        assert unary["request_id"] == "req-1" and unary["output_token_ids"] == list(range(10, 18))
        assert unary["finish_reason"] == "length"
        stream = _json_messages(outputs["vllm.engine.v1.VllmEngine/GenerateStream"])
        assert [t for m in stream for t in m["token_ids"]] == list(range(10, 18))
        assert stream[-1]["is_finished"] is True
        assert json.loads(outputs["vllm.engine.v1.VllmEngine/HealthCheck"])["status"] == "SERVING"
        assert json.loads(outputs["grpc.health.v1.Health/Check"])["status"] == "SERVING"
        assert json.loads(outputs["vllm.engine.v1.VllmEngine/ResetPrefixCache"])["success"] is True
        native = _json_messages(outputs["vllm.Inference/GenerateStream"])
        assert native[0]["prompt_info"]["num_prompt_tokens"] == 3
        assert [t for m in native[1:] for t in m["outputs"]["token_ids"]] == list(range(10, 18))
        assert native[-1]["outputs"]["finish_info"]["finish_reason"] == "LENGTH"
        assert json.loads(outputs["vllm.Control/GetServerInfo"])["api_version"] == "vllm"
        assert json.loads(outputs["vllm.engine.v1.VllmEngine/GetModelInfo"])["engine"] == "mock"
        complete = json.loads(outputs["vllm.grpc.engine.VllmEngine/Generate"])["complete"]
        assert complete["output_ids"] == list(range(10, 18))
        assert complete["finish_reason"] == "length"
        assert json.loads(outputs["vllm.grpc.engine.VllmEngine/HealthCheck"])["healthy"] is True
    finally:
        server.process.send_signal(signal.SIGTERM)
        await server.wait(15)


@pytest.mark.vllm
async def test_docs_router_grade_commands_on_the_real_engine(real: Harness) -> None:
    binary = grpcurl_path()
    require(binary is not None, "grpcurl is not installed (make install puts it in .venv/bin)")
    assert binary is not None
    commands = grpcurl_commands(CONTRACTS, 1)
    new_rpcs = {"Abort", "GetLoads", "GetTokenizer", "Embed", "ListLoraAdapters",
                "LoadLoraAdapter", "UnloadLoraAdapter"}  # fmt: skip
    assert {f"vllm.engine.v1.VllmEngine/{rpc}" for rpc in new_rpcs} <= {c[-1] for c in commands}
    substitutions = {"localhost:50051": real.address, "/models/my-lora": str(tiny_lora())}
    outputs, errors = {}, {}
    for command in commands:
        args = [_substitute(arg, substitutions) for arg in command[1:]]
        rpc = command[-1].rsplit("/", 1)[1]
        if rpc in VllmEngineServicer.control_rpcs:  # `real` has a control key, as deployed
            args = ["-H", f"authorization: Bearer {CONTROL_KEY}", *args]
        code, out, err = await _grpcurl(binary, args)
        if rpc == "Embed":  # a generation model: the wrong RPC, said clearly
            assert code != 0 and "FailedPrecondition" in err and "pooling" in err, err
            continue
        assert code == 0, (command, err)
        outputs[rpc], errors[rpc] = out, err
    generated = json.loads(outputs["Generate"])
    assert len(generated["samples"]) == 2
    assert all(re.fullmatch("[a-z]{2,6}-[0-9]", s["output_text"]) for s in generated["samples"])
    assert json.loads(outputs["Abort"]) == {}
    assert len(json.loads(outputs["GetLoads"])["ranks"]) == 1
    tokenizer = _json_messages(outputs["GetTokenizer"])
    assert len(tokenizer[-1]["sha256"]) == 64 and tokenizer[-1]["file_count"] >= 4
    listed = json.loads(outputs["ListLoraAdapters"])["adapters"]
    assert {"name": "my-lora", "path": str(tiny_lora())} in listed
    after = await real.stub.ListLoraAdapters(pb.ListLoraAdaptersRequest())
    assert "my-lora" not in [a.name for a in after.adapters]  # unloaded by the last line


def _substitute(arg: str, substitutions: dict[str, str]) -> str:
    for old, new in substitutions.items():
        arg = arg.replace(old, new)
    return arg
