"""vLLM's layerwise weight reload, as the file backend drives it in a vLLM worker process:
`initialize_layerwise_reload` / `finalize_layerwise_reload` (public), and the abort vLLM
0.32 lacks (its own sharded-RDT backend carries the same steps as a private helper,
`_restore_after_dry_run`, whose docstring asks for a public one).

Why an abort: initialize swaps every layer's parameters for meta tensors and keeps the live
ones aside (`LayerReloadingInfo.kernel_tensors`); a layer is rebuilt once all its weights
arrived. A load that fails half-way leaves the layers not yet rebuilt on meta tensors, and
the next forward pass kills the engine core. The abort puts each such layer's kept tensors
back and clears its reload state: layers rebuilt before the failure keep their new weights,
the rest their old ones, and a new initialize → load → finalize works.

The abort's private names are checked by `abort_problem()` (at the worker's start through
compat.py's touch point, and before each use): where they do not match, a failed load
cannot be undone, and the worker that served it exits for a restart instead of serving.
"""

from __future__ import annotations

from typing import Any

# vLLM's module and the private names the abort uses.
LAYERWISE = "vllm.model_executor.model_loader.reload.layerwise"
ABORT_NAMES = ("LAYERWISE_INFO", "LOADING_LAYERS", "_place_kernel_tensors")
INFO_NAMES = ("kernel_tensors", "can_load", "reset")


def abort_problem() -> str | None:
    """What keeps `abort` from running on this vLLM, or None."""
    try:
        import importlib

        from vllm.model_executor.model_loader.reload.types import LayerReloadingInfo

        layerwise = importlib.import_module(LAYERWISE)
    except ImportError as exc:
        return f"no layerwise reload ({exc})"
    gone = [name for name in ABORT_NAMES if not hasattr(layerwise, name)]
    fields = set(getattr(LayerReloadingInfo, "__dataclass_fields__", {})) | set(
        dir(LayerReloadingInfo)
    )
    gone += [f"LayerReloadingInfo.{name}" for name in INFO_NAMES if name not in fields]
    return f"{', '.join(gone)} gone from {LAYERWISE}" if gone else None


def initialize(model: Any) -> None:
    from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

    initialize_layerwise_reload(model)


def finalize(model: Any, model_config: Any) -> None:
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

    finalize_layerwise_reload(model, model_config)


def abort(model: Any) -> None:
    """Undo what a reload left half-done (see the module doc). Raises RuntimeError where
    this vLLM's names do not match: the model then cannot be made consistent."""
    problem = abort_problem()
    if problem is not None:
        raise RuntimeError(f"cannot undo a failed weight load on this vLLM: {problem}")
    from vllm.model_executor.model_loader.reload import layerwise

    for layer in model.modules():
        info = layerwise.LAYERWISE_INFO.get(layer)  # .get: creates no entry
        if info is None or not info.can_load():
            continue
        # The kept tensors go back before the reset (which drops them): the other order
        # loses the layer's real storage for good.
        if info.kernel_tensors is not None:
            layerwise._place_kernel_tensors(layer, info)
        info.reset()
    if hasattr(model, "_original_do_torchao_reload"):
        model._do_torchao_reload = model._original_do_torchao_reload
    layerwise.LOADING_LAYERS.clear()


def in_progress(model: Any) -> bool:
    """Whether some layer of `model` is left mid-reload (an earlier load that died)."""
    if abort_problem() is not None:
        return False
    from vllm.model_executor.model_loader.reload import layerwise

    for layer in model.modules():
        info = layerwise.LAYERWISE_INFO.get(layer)
        if info is not None and info.can_load():
            return True
    return False
