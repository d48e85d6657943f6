"""The file backend's engine (see file_weights.py), in the worker process: imported only by
vLLM's factory when a worker's `--weight-transfer-config` names it, as it subclasses vLLM's
`WeightTransferEngine`."""

from __future__ import annotations

import os
from typing import Any, cast

from vllm.distributed.weight_transfer.base import WeightTransferEngine

from .file_weights import FileInitInfo, FileUpdateInfo, parse, read_weights


class FileWeightTransferEngine(WeightTransferEngine):  # type: ignore[type-arg]
    """Weights in checkpoint format from a safetensors file, loaded through vLLM's layerwise
    reload as its NCCL and IPC backends load theirs (on CPU the linear weights are repacked
    at load, so a plain `load_weights` into the running model would not do)."""

    init_info_cls = FileInitInfo
    update_info_cls = FileUpdateInfo

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._root: str | None = None

    def parse_init_info(self, init_dict: dict[str, Any]) -> FileInitInfo:
        info: FileInitInfo = parse(FileInitInfo, init_dict, "init_info")
        return info

    def parse_update_info(self, update_dict: dict[str, Any]) -> FileUpdateInfo:
        info: FileUpdateInfo = parse(FileUpdateInfo, update_dict, "update_info")
        return info

    def init_transfer_engine(self, init_info: FileInitInfo) -> None:
        self._root = os.path.realpath(init_info.root_dir) if init_info.root_dir else None

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # vLLM's version ends with torch.accelerator.synchronize(), which raises where
        # there is no accelerator; a file read is synchronous anyway.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: FileUpdateInfo) -> None:
        weights = read_weights(update_info, self._root)
        from vllm.model_executor.model_loader.mtp_validation import (
            disable_mtp_completeness_check,
        )

        with disable_mtp_completeness_check():
            # vLLM's models take checkpoint-named tensors (an nn.Module's attribute).
            cast(Any, self.model).load_weights(weights)

    def shutdown(self) -> None:
        self._root = None
