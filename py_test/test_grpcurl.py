"""A non-Python client (grpcurl, Go's gRPC stack) runs the README's commands via reflection."""

from __future__ import annotations

import asyncio
import json
import re
import shlex
import signal
from pathlib import Path

import servers
from harness import grpcurl_path, require

README = Path(__file__).resolve().parent.parent / "README.md"


def readme_grpcurl_commands() -> list[list[str]]:
    section = README.read_text().split("## Try it with grpcurl", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, "README lost its grpcurl examples"
    return [
        shlex.split(line) for line in block.group(1).splitlines() if line.startswith("grpcurl ")
    ]


async def _grpcurl(binary: str, args: list[str]) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        binary, *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(process.communicate(), 30)
    return process.returncode, out.decode(), err.decode()


async def test_readme_grpcurl_commands_work_as_printed() -> None:
    binary = grpcurl_path()
    require(binary is not None, "grpcurl is not installed (make install puts it in .venv/bin)")
    commands = readme_grpcurl_commands()
    called = {cmd[-1] for cmd in commands}
    for rpc in (
        "GenerateStream",
        "Generate",
        "GetModelInfo",
        "HealthCheck",
        "ResetPrefixCache",
    ):
        assert f"vllm.engine.v1.VllmEngine/{rpc}" in called
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
        stream = [
            json.loads(chunk)
            for chunk in re.split(
                r"(?<=\})\n(?=\{)", outputs["vllm.engine.v1.VllmEngine/GenerateStream"].strip()
            )
        ]
        assert [t for m in stream for t in m["token_ids"]] == list(range(10, 18))
        assert stream[-1]["is_finished"] is True
        assert json.loads(outputs["vllm.engine.v1.VllmEngine/HealthCheck"])["status"] == "SERVING"
        assert json.loads(outputs["grpc.health.v1.Health/Check"])["status"] == "SERVING"
        assert json.loads(outputs["vllm.engine.v1.VllmEngine/ResetPrefixCache"])["success"] is True
        assert json.loads(outputs["vllm.engine.v1.VllmEngine/GetModelInfo"])["engine"] == "mock"
    finally:
        server.process.send_signal(signal.SIGTERM)
        await server.wait(15)
