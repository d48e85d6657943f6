"""The neutral media types: images (and other items) of a prompt, as bytes, URLs or tensors.

A contract converts its media fields into these; the serving core fetches URLs
(`core.media_admission`); an engine adapter decodes and processes them (vLLM:
`engine.vllm.media_inputs`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class MediaItem:
    """One media item of a prompt, in prompt order: encoded bytes (PNG, JPEG, ...) or a
    URL the serving core fetches before the engine sees the request (exactly one set).

    The prompt carries one placeholder per item, as the model's chat template writes it;
    the engine's processor expands it to the item's full run of feature tokens.
    """

    modality: str  # "image", ...
    data: bytes | None = None
    url: str | None = None
    # The caller's id for this content (vLLM's multi_modal_uuids): the prefix cache's key
    # instead of a hash of the bytes. None: the engine hashes the content.
    uuid: str | None = None


# Element sizes of the tensor dtypes a contract may send (names as torch spells them).
DTYPE_SIZES: Mapping[str, int] = {
    "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "uint32": 4,
    "uint8": 1, "bool": 1,
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class RawTensor:
    """A dense array as it came off the wire: little-endian, C order, len(data) checked."""

    dtype: str  # a DTYPE_SIZES key
    shape: tuple[int, ...]
    data: bytes


# How one processor output splits into items (vLLM's MultiModalFieldConfig kinds):
# "batched" (one row per item), ("flat", sizes key) (rows per item given by another
# output), "shared" (the same value for every item).
TensorLayout = str | tuple[str, str]


@dataclass(frozen=True, slots=True)
class ProcessedMedia:
    """Items of one modality that the model's own processor already turned into tensors
    (a router that preprocesses images): the engine runs no processor for them, and the
    prompt carries every item's placeholder run already expanded.

    `tensors` maps the processor's output names (e.g. "pixel_values") to their arrays;
    `placeholders` is (offset, length) of each item's run in the prompt; `hashes` names
    each item's content for the prefix cache (equal content, equal hash). `layout` None:
    the tensors split into items as the model's processor lays them out.
    """

    modality: str
    tensors: Mapping[str, RawTensor]
    placeholders: tuple[tuple[int, int], ...]
    hashes: tuple[str, ...]
    layout: Mapping[str, TensorLayout] | None = None
    # Within each run, only positions holding this token get an item's features (the rest
    # are the model's delimiters). None: every position does.
    embed_token_id: int | None = None
