"""A weight-transfer backend for vLLM that reads the new weights from safetensors files: the
trainer writes a file, `UpdateWeights` names it. For CPU workers (vLLM ships only GPU
backends: NCCL, CUDA IPC) and for tests; registered in every vLLM process of this
environment through a `vllm.general_plugins` entry point (pyproject.toml), so an engine
started with `--weight-transfer-config '{"backend": "file"}'` finds it in its workers —
vLLM's own servers (vllm-rs, `vllm serve`) included.

The JSON a trainer sends (`init_info`, `update_info`, as for every backend):
- init: `{}` or `{"root_dir": "/shared/weights"}`: only files under it may be read;
- update: `{"path": "/shared/weights/step-7.safetensors"}`, optionally
  `"names": [...]` to load only some of its tensors. Names are the checkpoint's (Hugging Face)
  names, as in the model's own safetensors; each layer touched must be sent whole (vLLM's
  layerwise reload rebuilds a layer from what it received).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

BACKEND = "file"


def register() -> None:
    """The plugin's entry point: register the backend with vLLM's factory (lazily: the
    module below is imported only by a worker that is configured with it). Runs in every
    vLLM process; registering twice is harmless."""
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError:  # a vLLM without weight transfer: nothing to register
        return
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            BACKEND, "vllm_router.engine.vllm.file_weights_engine", "FileWeightTransferEngine"
        )


@dataclass
class FileInitInfo:
    """What `InitWeightTransferEngine` takes: an optional directory the files must be in."""

    root_dir: str | None = None

    def __post_init__(self) -> None:
        if self.root_dir is not None and (not isinstance(self.root_dir, str) or not self.root_dir):
            raise ValueError("root_dir must be a non-empty string")


@dataclass
class FileUpdateInfo:
    """What `UpdateWeights` takes: a safetensors file and, optionally, which of its tensors."""

    path: str
    names: list[str] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.path, str) or not self.path:
            raise ValueError("path must be a non-empty string (a safetensors file)")
        if self.names is not None and (
            not isinstance(self.names, list) or not all(isinstance(n, str) for n in self.names)
        ):
            raise ValueError("names must be a list of tensor names")


def read_weights(info: FileUpdateInfo, root: str | None) -> list[tuple[str, torch.Tensor]]:
    """Every tensor the update names, read and checked before the model is touched: a
    failure once vLLM's layerwise reload has started loading leaves layers half-built."""
    from safetensors import safe_open

    path = os.path.realpath(info.path)
    if root is not None and os.path.commonpath([root, path]) != root:
        raise ValueError(f"update_info.path {info.path!r} is outside root_dir {root!r}")
    if not os.path.isfile(path):
        raise ValueError(f"update_info.path {info.path!r} is not a file")
    try:
        with safe_open(path, framework="pt", device="cpu") as weights:
            available = set(weights.keys())
            names = info.names if info.names is not None else sorted(available)
            missing = [name for name in names if name not in available]
            if missing:
                raise ValueError(f"tensors not in {info.path!r}: {missing[:5]}")
            return [(name, weights.get_tensor(name)) for name in names]
    except ValueError:
        raise
    except Exception as exc:  # safetensors' own errors: a truncated or foreign file
        raise ValueError(f"cannot read {info.path!r} as safetensors: {exc}") from exc


def parse(cls: type[Any], info: dict[str, Any], what: str) -> Any:
    """`cls(**info)`, its failures told as vLLM's backends tell them."""
    if not isinstance(info, dict):
        raise ValueError(f"{what} must be a JSON object")
    try:
        return cls(**info)
    except TypeError as exc:
        raise ValueError(f"Invalid {what} for the file backend: {exc}") from exc
