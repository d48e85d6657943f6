"""Engines behind the servicers: the protocol, its neutral types, and the adapters.

`vllm.py` adapts vLLM's AsyncLLM (imported lazily); the mock lives in
`vllm_router.testing`. Nothing in this package imports gRPC contracts.
"""

from .media import DTYPE_SIZES, MediaItem, ProcessedMedia, RawTensor
from .protocol import AsyncEngine
from .types import (
    NEUTRAL_DEFAULT,
    Embedding,
    EngineStep,
    FinishReason,
    GenerationRequest,
    KvBlocksRemoved,
    KvBlocksStored,
    KvCacheCleared,
    KvEventBatch,
    LoadSnapshot,
    LoraAdapter,
    ModelFacts,
    RankLoad,
    SamplingOptions,
    StructuredOutputs,
    TokenLogprob,
)

__all__ = [
    "DTYPE_SIZES",
    "NEUTRAL_DEFAULT",
    "AsyncEngine",
    "Embedding",
    "EngineStep",
    "FinishReason",
    "GenerationRequest",
    "KvBlocksRemoved",
    "KvBlocksStored",
    "KvCacheCleared",
    "KvEventBatch",
    "LoadSnapshot",
    "LoraAdapter",
    "MediaItem",
    "ModelFacts",
    "ProcessedMedia",
    "RankLoad",
    "RawTensor",
    "SamplingOptions",
    "StructuredOutputs",
    "TokenLogprob",
]
