"""A prompt with media -> vLLM's multimodal engine input, with no work on the event loop.

Two forms reach here (see `engine.types`):
- items as encoded bytes (URLs were fetched by the serving core): decoded with vLLM's
  own image loader (what its servers use for `image_url`, so pixels are identical) in a
  worker thread, then run through the model's own processor by vLLM's renderer
  (`process_for_engine_async`, on the renderer's processing thread), which expands each
  placeholder of the prompt and hashes each item for the prefix cache;
- a router's processor outputs: tensors rebuilt into vLLM's per-item kwargs with the
  layout the router names (or the model processor's own), their placeholder runs and
  hashes given, assembled in a worker thread (vLLM's `mm_input`), no processor run.

Failures a client caused (bytes that do not decode, a placeholder count that does not
match, tensors of the wrong size) are raised as InvalidRequest with vLLM's message.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ...errors import InvalidRequest
from ..media_types import MediaItem, ProcessedMedia, RawTensor
from ..types import GenerationRequest
from .params import reraise

if TYPE_CHECKING:
    from vllm.v1.engine.async_llm import AsyncLLM


def _decode(item: MediaItem, index: int, field_name: str, media_io_kwargs: Mapping[str, Any]):
    """An image's bytes -> vLLM's decoded image (with its bytes kept for hashing)."""
    from vllm.multimodal.media.image import ImageMediaIO

    if item.modality != "image":
        raise InvalidRequest(f"{field_name}[{index}]: modality {item.modality!r} is not served")
    loader = ImageMediaIO(**({"image_mode": "RGB"} | dict(media_io_kwargs.get("image", {}))))
    try:
        return loader.load_bytes(item.data or b"")
    except ValueError as exc:
        raise InvalidRequest(f"{field_name}[{index}]: {exc}") from exc


async def media_input(llm: AsyncLLM, ids: list[int], request: GenerationRequest) -> Any:
    """vLLM's engine input for a prompt with `request.media` (encoded items)."""
    mm_config = llm.model_config.multimodal_config
    media_io_kwargs = (mm_config.media_io_kwargs if mm_config else None) or {}
    decoded = await asyncio.gather(
        *(
            asyncio.to_thread(_decode, item, i, request.media_field, media_io_kwargs)
            for i, item in enumerate(request.media)
        )
    )
    data: dict[str, list[Any]] = defaultdict(list)
    uuids: dict[str, list[str | None]] = defaultdict(list)
    for item, image in zip(request.media, decoded, strict=True):
        data[item.modality].append(image)
        uuids[item.modality].append(item.uuid)
    prompt: dict[str, Any] = {"prompt_token_ids": ids, "multi_modal_data": dict(data)}
    if request.cache_salt:
        prompt["cache_salt"] = request.cache_salt
    if any(uuid is not None for values in uuids.values() for uuid in values):
        prompt["multi_modal_uuids"] = dict(uuids)
    try:
        # skip_mm_cache: every item's data goes with the request. vLLM's sender-side
        # cache would send an item it believes the engine core holds as None; a request
        # refused between processing and admission would leave the two caches disagreeing.
        engine_input = await llm.renderer.process_for_engine_async(
            prompt,  # type: ignore[arg-type]
            arrival_time=time.time(),
            skip_mm_cache=True,
        )
    except (AssertionError, RuntimeError) as exc:
        # vLLM's processor found fewer placeholders than items ("Failed to apply prompt
        # replacement for mm_items['image'][1]").
        raise InvalidRequest(
            f"{request.media_field}: the prompt has fewer placeholders than the "
            f"{len(request.media)} items sent ({exc})"
        ) from exc
    except Exception as exc:
        # An image over the model's limits, more items than --limit-mm-per-prompt, ...
        reraise(exc)
    _check_no_placeholder_left(engine_input, request)
    return engine_input


def _check_no_placeholder_left(engine_input: Any, request: GenerationRequest) -> None:
    """vLLM expands as many placeholders as there are items and leaves any extra one in
    the prompt as a plain token: a request with more placeholders than items is refused
    here (the feature tokens of the expanded runs must not appear outside them)."""
    ids = engine_input["prompt_token_ids"]
    inside: set[int] = set()
    feature_tokens: set[int] = set()
    for ranges in engine_input.get("mm_placeholders", {}).values():
        for run in ranges:
            positions = range(run.offset, run.offset + run.length)
            inside.update(positions)
            mask = run.is_embed
            feature_tokens.update(
                ids[p] for i, p in enumerate(positions) if mask is None or bool(mask[i])
            )
    left = [p for p, token in enumerate(ids) if token in feature_tokens and p not in inside]
    if left:
        raise InvalidRequest(
            f"{request.media_field}: the prompt has more placeholders than the "
            f"{len(request.media)} items sent (placeholder token {ids[left[0]]} left at "
            f"position {left[0]} of the expanded prompt)"
        )


async def processed_input(llm: AsyncLLM, ids: list[int], request: GenerationRequest) -> Any:
    """vLLM's engine input for a prompt with `request.processed_media` (tensors)."""
    return await asyncio.to_thread(_assemble, llm, ids, request)


def _tensor(raw: RawTensor, model_dtype: Any) -> Any:
    import torch

    # The dtype names are torch's (engine.DTYPE_SIZES); the bytes were checked to fit.
    dtype = getattr(torch, raw.dtype)
    if not raw.data:  # a zero-sized shape (frombuffer refuses an empty buffer)
        tensor = torch.empty(raw.shape, dtype=dtype)
    else:
        tensor = torch.frombuffer(bytearray(raw.data), dtype=dtype).reshape(raw.shape)
    # Floating inputs run in the model's dtype, as the model's processor output would.
    return tensor.to(model_dtype) if tensor.is_floating_point() else tensor


def _fields(batch: ProcessedMedia, hf_inputs: Any, llm: AsyncLLM) -> Mapping[str, Any]:
    """How the batch's tensors split into items (vLLM's MultiModalFieldConfig per key)."""
    from vllm.multimodal.inputs import MultiModalFieldConfig

    if batch.layout is None:
        processor = llm.renderer.get_mm_processor()
        return processor._get_mm_fields_config(hf_inputs, {})
    fields: dict[str, Any] = {}
    for key in hf_inputs:
        layout = batch.layout.get(key, "shared")
        if layout == "batched":
            fields[key] = MultiModalFieldConfig.batched(batch.modality)
        elif isinstance(layout, tuple):
            sizes = hf_inputs.get(layout[1])
            if sizes is None:
                raise InvalidRequest(
                    f"{key} is laid out by sizes in {layout[1]!r}, which was not sent"
                )
            fields[key] = MultiModalFieldConfig.flat_from_sizes(
                batch.modality, sizes.flatten().long()
            )
        else:
            fields[key] = MultiModalFieldConfig.shared(batch.modality, len(batch.placeholders))
    return fields


def _assemble(llm: AsyncLLM, ids: list[int], request: GenerationRequest) -> Any:
    import torch
    from transformers import BatchFeature
    from vllm.inputs.engine import mm_input
    from vllm.multimodal.inputs import MultiModalKwargsItems, PlaceholderRange

    model_dtype = llm.model_config.dtype
    items: dict[str, list[Any]] = defaultdict(list)
    hashes: dict[str, list[str]] = defaultdict(list)
    placeholders: dict[str, list[Any]] = defaultdict(list)
    for number, batch in enumerate(request.processed_media):
        where = f"{request.media_field} batch {number}"
        hf_inputs = BatchFeature(
            {key: _tensor(value, model_dtype) for key, value in batch.tensors.items()}
        )
        try:
            built = MultiModalKwargsItems.from_hf_inputs(hf_inputs, _fields(batch, hf_inputs, llm))
        except (ValueError, RuntimeError, IndexError) as exc:
            raise InvalidRequest(f"{where}: the tensors do not split into items: {exc}") from exc
        got = list(built.get(batch.modality, ()))
        if len(got) != len(batch.placeholders):
            raise InvalidRequest(
                f"{where}: the tensors hold {len(got)} {batch.modality} items but "
                f"{len(batch.placeholders)} placeholder runs were sent"
            )
        items[batch.modality].extend(got)
        hashes[batch.modality].extend(batch.hashes)
        for offset, length in batch.placeholders:
            mask = None
            if batch.embed_token_id is not None:
                run = torch.tensor(ids[offset : offset + length])
                mask = run == batch.embed_token_id
                if bool(mask.all()):
                    mask = None
            placeholders[batch.modality].append(PlaceholderRange(offset, length, is_embed=mask))
    engine_input = mm_input(
        ids, MultiModalKwargsItems(dict(items)), dict(hashes), dict(placeholders)
    )
    engine_input["arrival_time"] = time.time()
    if request.cache_salt:
        engine_input["cache_salt"] = request.cache_salt
    return engine_input
