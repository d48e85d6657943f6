"""Build hook: compile proto/vllm_engine.proto into the package at build time.

The generated modules are never checked in. They are written into the source
package (so editable installs see them) before setuptools copies modules.
"""

from __future__ import annotations

import re
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
PROTO_DIR = ROOT / "proto"
OUT_DIR = ROOT / "py_src" / "vllm_router" / "proto"


def generate_stubs() -> None:
    from grpc_tools import protoc  # build-system requirement, pinned in pyproject

    import grpc_tools

    well_known = Path(grpc_tools.__file__).parent / "_proto"
    protos = sorted(PROTO_DIR.glob("*.proto"))
    if not protos:
        raise RuntimeError(f"no .proto files under {PROTO_DIR}")
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_DIR}",
        f"-I{well_known}",
        f"--python_out={OUT_DIR}",
        f"--pyi_out={OUT_DIR}",
        f"--grpc_python_out={OUT_DIR}",
        *(str(p) for p in protos),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed on " + ", ".join(p.name for p in protos))
    # protoc emits top-level imports between generated modules; inside a package
    # they must be relative.
    names = "|".join(re.escape(p.stem) for p in protos)
    pattern = re.compile(rf"^import ({names})_pb2 as ", re.MULTILINE)
    for generated in OUT_DIR.glob("*_pb2*.py*"):
        text = generated.read_text()
        fixed = pattern.sub(r"from . import \1_pb2 as ", text)
        if fixed != text:
            generated.write_text(fixed)


class BuildPyWithStubs(build_py):
    def run(self) -> None:
        generate_stubs()
        super().run()

    def get_source_files(self) -> list[str]:
        # sdists ship the .proto (MANIFEST.in), not what it generates.
        return [f for f in super().get_source_files() if "_pb2" not in Path(f).name]


setup(cmdclass={"build_py": BuildPyWithStubs})
