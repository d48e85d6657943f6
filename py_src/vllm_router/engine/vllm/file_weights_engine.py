"""The file backend's engine (see file_weights.py), in the worker process: imported only by
vLLM's factory when a worker's `--weight-transfer-config` names it, as it subclasses vLLM's
`WeightTransferEngine`.

The model is touched in one place: `finish_weight_update`. Start opens a staging area,
each UpdateWeights checks its chunk and stages it (a retried chunk is taken once, a wrong
one refused with the model untouched), and Finish reads every staged tensor, then runs
vLLM's layerwise reload (initialize, load, finalize) in that one call, between two engine
steps: generation may go on while an update is open, and no forward pass ever meets a
half-loaded model. A load that fails in Finish is undone (weight_reload.abort) before the
error goes back, so the model is consistent and a new update can start.
"""

from __future__ import annotations

import logging
from typing import Any, cast

from vllm.distributed.weight_transfer.base import WeightTransferEngine

from .file_weights import (
    NOT_RESTORED,
    UNCHANGED,
    FileInitInfo,
    FileUpdateInfo,
    Staging,
    checkpoint_shapes,
    configured_root,
    narrowed_root,
    parse,
)
from .weight_reload import abort, finalize, in_progress, initialize

logger = logging.getLogger(__name__)


class FileWeightTransferEngine(WeightTransferEngine):  # type: ignore[type-arg]
    """Weights in checkpoint format from safetensors files, loaded through vLLM's layerwise
    reload as its NCCL and IPC backends load theirs (on CPU the linear weights are repacked
    at load, so a plain `load_weights` into the running model would not do)."""

    init_info_cls = FileInitInfo
    update_info_cls = FileUpdateInfo

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # The operator's root, read in this (vLLM worker) process; Init may narrow it.
        self._worker_root = configured_root()
        self._root = self._worker_root
        self._staging: Staging | None = None
        self._reference: dict[str, tuple[int, ...]] | None = None

    def parse_init_info(self, init_dict: dict[str, Any]) -> FileInitInfo:
        info: FileInitInfo = parse(FileInitInfo, init_dict, "init_info")
        return info

    def parse_update_info(self, update_dict: dict[str, Any]) -> FileUpdateInfo:
        info: FileUpdateInfo = parse(FileUpdateInfo, update_dict, "update_info")
        return info

    def init_transfer_engine(self, init_info: FileInitInfo) -> None:
        self._root = narrowed_root(self._worker_root, init_info.root_dir)

    def start_weight_update(self) -> None:
        # A load that died without its abort (a crash between two calls) left layers
        # mid-reload: they go back to their kept weights before anything new is staged.
        if in_progress(self.model):
            logger.warning("A weight load was left half-done: restoring it before this update")
            abort(self.model)
        if self._reference is None:
            self._reference = checkpoint_shapes(str(self.model_config.model))
        self._staging = Staging(self._reference)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # vLLM's version ends with torch.accelerator.synchronize(), which raises where
        # there is no accelerator; staging is synchronous anyway.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: FileUpdateInfo) -> None:
        if self._staging is None:  # vLLM's worker checks the order first: not reached
            raise ValueError("no weight update is open in this worker")
        try:
            staged = self._staging.add(update_info, self._root)
        except ValueError as exc:
            self._staging = None  # vLLM's worker ends the update on any failure
            raise ValueError(f"{exc} ({UNCHANGED})") from None
        if not staged:
            logger.info("UpdateWeights repeats a staged chunk (%s): taken once", update_info.path)

    def finish_weight_update(self) -> None:
        staging, self._staging = self._staging, None
        if staging is None or not staging.chunks:
            return  # nothing sent: the model stays as it was
        try:
            weights = staging.read(self._root)
        except ValueError as exc:
            raise ValueError(f"{exc} ({UNCHANGED})") from None
        from vllm.model_executor.model_loader.mtp_validation import (
            disable_mtp_completeness_check,
        )

        try:
            initialize(self.model)
            with disable_mtp_completeness_check():
                # vLLM's models take checkpoint-named tensors (an nn.Module's attribute).
                cast(Any, self.model).load_weights(weights)
            finalize(self.model, self.model_config)
        except Exception as exc:
            try:
                abort(self.model)
            except Exception as undo:
                raise RuntimeError(f"{exc}; {NOT_RESTORED}: {undo}") from exc
            raise

    def shutdown(self) -> None:
        self._root = self._worker_root
        self._staging = None
