"""Build hook: compile proto/vllm_engine.proto into the package at build time.

The generated modules are never checked in. They are written into the source
package (so editable installs see them) before setuptools copies modules.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
PROTO_DIR = ROOT / "proto"
OUT_DIR = ROOT / "py_src" / "vllm_router" / "proto"


def generate_stubs() -> None:
    """Compile each proto as `vllm_router/proto/<name>.proto`.

    The import path becomes the name protobuf registers the file under: a
    package-qualified one cannot collide with another project's
    `vllm_engine.proto` in the same process (vLLM's own gRPC stubs use that
    name), and the generated modules import each other absolutely.
    """
    import grpc_tools
    from grpc_tools import protoc  # build-system requirement, pinned in pyproject

    well_known = Path(grpc_tools.__file__).parent / "_proto"
    protos = sorted(PROTO_DIR.glob("*.proto"))
    if not protos:
        raise RuntimeError(f"no .proto files under {PROTO_DIR}")
    with tempfile.TemporaryDirectory() as root:
        staged_dir = Path(root) / "vllm_router" / "proto"
        staged_dir.mkdir(parents=True)
        for proto in protos:
            shutil.copyfile(proto, staged_dir / proto.name)
        args = [
            "grpc_tools.protoc",
            f"-I{root}",
            f"-I{well_known}",
            f"--python_out={OUT_DIR.parent.parent}",
            f"--pyi_out={OUT_DIR.parent.parent}",
            f"--grpc_python_out={OUT_DIR.parent.parent}",
            *(f"vllm_router/proto/{p.name}" for p in protos),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError("protoc failed on " + ", ".join(p.name for p in protos))


class BuildPyWithStubs(build_py):
    def run(self) -> None:
        generate_stubs()
        super().run()

    def get_source_files(self) -> list[str]:
        # sdists ship the .proto (MANIFEST.in), not what it generates.
        return [f for f in super().get_source_files() if "_pb2" not in Path(f).name]


setup(cmdclass={"build_py": BuildPyWithStubs})
