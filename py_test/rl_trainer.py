"""The tests' RL trainer: new weights for the tiny model, written as a trainer using the file
weight-transfer backend writes them (a safetensors file of checkpoint-named tensors), and a
checkpoint directory of the same weights (what a worker started on them loads).

Run as a script (`python rl_trainer.py BASE_DIR OUT_DIR`): torch stays out of the test
process, as for the tiny model itself (real_engine.tiny_model).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

WEIGHTS = "model.safetensors"


def trained(base: Path, out: Path) -> Path:
    """`base`'s checkpoint with every weight moved (a fixed seed: the same on every run),
    built once into `out`; its safetensors file is `out / WEIGHTS`."""
    if not (out / WEIGHTS).exists():
        subprocess.run(
            [sys.executable, __file__, str(base), str(out)],
            check=True,
            capture_output=True,
            timeout=300,
        )
    return out


def _write(base: Path, out: Path) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    staging = out.with_name(out.name + ".staging")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(base, staging)
    generator = torch.Generator().manual_seed(7)
    weights = load_file(str(base / WEIGHTS))
    moved = {}
    for name, tensor in sorted(weights.items()):
        noise = torch.randn(tensor.shape, generator=generator, dtype=torch.float32)
        scale = tensor.float().std() if tensor.numel() > 1 else 1.0
        moved[name] = (tensor.float() + 0.5 * scale * noise).to(tensor.dtype).contiguous()
    save_file(moved, str(staging / WEIGHTS))
    staging.rename(out)


def _header(path: Path) -> dict[str, object]:
    raw = path.read_bytes()
    size = int.from_bytes(raw[:8], "little")
    header: dict[str, object] = json.loads(raw[8 : 8 + size])
    header.pop("__metadata__", None)
    return header


def tensor_names(path: Path) -> list[str]:
    """The tensors of a safetensors file (its header, read by hand)."""
    return sorted(_header(path))


def write_safetensors(
    target: Path,
    tensors: dict[str, tuple[str, list[int], bytes]],
    copy_from: Path | None = None,
) -> None:
    """A safetensors file (written by hand: torch stays out of the test process) of
    `tensors` (name: dtype, shape, raw bytes), after every tensor of `copy_from`."""
    header: dict[str, object] = {}
    data = b""
    if copy_from is not None:
        raw = copy_from.read_bytes()
        header = _header(copy_from)
        data = raw[8 + int.from_bytes(raw[:8], "little") :]
    for name, (dtype, shape, values) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape,
                        "data_offsets": [len(data), len(data) + len(values)]}  # fmt: skip
        data += values
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)  # the header is padded to 8 bytes
    target.write_bytes(len(encoded).to_bytes(8, "little") + encoded + data)


if __name__ == "__main__":
    _write(Path(sys.argv[1]), Path(sys.argv[2]))
