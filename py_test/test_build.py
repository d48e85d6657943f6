"""Packaging: stubs are generated at build time, shipped in the wheel, never in the sdist."""

from __future__ import annotations

import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GENERATED = ("vllm_engine_pb2.py", "vllm_engine_pb2_grpc.py", "vllm_engine_pb2.pyi")


@pytest.mark.slow  # make test only: it waits or builds for over ten seconds
def test_sdist_then_wheel_contains_generated_stubs(tmp_path: Path) -> None:
    # `python -m build` builds the sdist, then the wheel *from that sdist*.
    result = subprocess.run(
        [sys.executable, "-m", "build", "--outdir", str(tmp_path), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (sdist,) = tmp_path.glob("*.tar.gz")
    (wheel,) = tmp_path.glob("*.whl")
    # The distribution is named after the product; the vllm-project's router owns `vllm-router`.
    assert wheel.name.startswith("vllm_servicer-"), wheel.name
    with tarfile.open(sdist) as tar:
        sdist_names = tar.getnames()
    assert any(n.endswith("proto/vllm_engine.proto") for n in sdist_names)
    assert not any("_pb2" in n for n in sdist_names), "generated stubs leaked into the sdist"
    with zipfile.ZipFile(wheel) as whl:
        wheel_names = set(whl.namelist())
        grpc_module = whl.read("vllm_router/proto/vllm_engine_pb2_grpc.py").decode()
    for name in GENERATED:
        assert f"vllm_router/proto/{name}" in wheel_names
    # What compat.CHECKED_VERSIONS is read from at import.
    assert "vllm_router/engine/vllm/checked_versions.json" in wheel_names
    assert "from vllm_router.proto import vllm_engine_pb2 as" in grpc_module
    assert "GRPC_GENERATED_VERSION = '1.85.1'" in grpc_module


def test_stubs_are_not_tracked_by_git() -> None:
    tracked = subprocess.run(
        ["git", "ls-files", "py_src/vllm_router/proto"], cwd=ROOT, capture_output=True, text=True
    ).stdout.split()
    assert tracked and not [p for p in tracked if "_pb2" in p], tracked


def test_no_packages_archives_or_large_files_are_tracked() -> None:
    """Tools are installed by the Makefile, never committed (a 2.9 MB py-spy wheel once was,
    by accident, and went into every clone)."""
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    packaged = [p for p in tracked if p.endswith((".whl", ".tar.gz", ".zip", ".so", ".egg"))]
    large = [p for p in tracked if (ROOT / p).is_file() and (ROOT / p).stat().st_size > 512_000]
    assert tracked and not packaged and not large, (packaged, large)


def test_proto_is_registered_under_a_package_qualified_name() -> None:
    # Another project's `vllm_engine.proto` (vLLM's own gRPC stubs) can live in the same process.
    from vllm_router.proto import vllm_engine_pb2

    assert vllm_engine_pb2.DESCRIPTOR.name == "vllm_router/proto/vllm_engine.proto"
    assert vllm_engine_pb2.DESCRIPTOR.package == "vllm.engine.v1"


def test_missing_stubs_raise_an_import_error_that_says_reinstall() -> None:
    code = (
        "import sys; sys.modules['vllm_router.proto.vllm_engine_pb2'] = None\n"
        "try:\n    import vllm_router.proto\nexcept ImportError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout
    assert "Reinstall the package" in out
