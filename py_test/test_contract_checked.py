"""The checked contract: buf lint passes, and buf breaking catches a breaking edit."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from harness import require, tool_path

ROOT = Path(__file__).resolve().parent.parent


def _run(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    buf = tool_path("buf")
    require(buf is not None, "buf is not installed (make install: buf-bin)")
    assert buf is not None
    return subprocess.run([buf, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_the_contract_passes_buf_lint() -> None:
    result = _run("lint")
    assert result.returncode == 0, result.stdout + result.stderr


def test_buf_breaking_catches_a_renumbered_field(tmp_path: Path) -> None:
    edited = tmp_path / "edited"
    shutil.copytree(ROOT / "proto", edited / "proto")
    shutil.copy(ROOT / "buf.yaml", edited / "buf.yaml")
    proto = edited / "proto" / "vllm_engine.proto"
    text = proto.read_text()
    assert "  string lora_name = 9;" in text
    proto.write_text(text.replace("  string lora_name = 9;", "  string lora_name = 99;"))
    unchanged = _run("breaking", str(ROOT), "--against", str(ROOT))
    assert unchanged.returncode == 0, unchanged.stdout + unchanged.stderr
    broken = _run("breaking", str(edited), "--against", str(ROOT))
    assert broken.returncode != 0
    assert "lora_name" in broken.stdout + broken.stderr
