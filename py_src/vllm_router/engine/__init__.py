"""Engines behind the servicers: the protocol, its neutral types, and the adapters.

`vllm/` adapts vLLM's AsyncLLM (imported lazily); the mock lives in
`vllm_router.testing`. Nothing in this package imports gRPC contracts.
"""

from .direct import DirectReceiver, DirectSteps, takes_direct_steps
from .media_types import DTYPE_SIZES, MediaItem, ProcessedMedia, RawTensor
from .protocol import NO_DRAFT_MODEL, NO_WEIGHT_TRANSFER, AsyncEngine, PauseMode
from .types import (
    NEUTRAL_DEFAULT,
    Embedding,
    EngineProgress,
    EngineStep,
    FinishReason,
    GenerationRequest,
    KvBlocksRemoved,
    KvBlocksStored,
    KvCacheCleared,
    KvEventBatch,
    KvEventSource,
    LoadSnapshot,
    LoraAdapter,
    ModelFacts,
    RankLoad,
    SamplingOptions,
    SpecDecodeCounts,
    StructuredOutputs,
    TokenLogprob,
)

__all__ = [
    "DTYPE_SIZES",
    "NEUTRAL_DEFAULT",
    "NO_DRAFT_MODEL",
    "NO_WEIGHT_TRANSFER",
    "AsyncEngine",
    "DirectReceiver",
    "DirectSteps",
    "Embedding",
    "EngineProgress",
    "EngineStep",
    "FinishReason",
    "GenerationRequest",
    "KvBlocksRemoved",
    "KvBlocksStored",
    "KvCacheCleared",
    "KvEventBatch",
    "KvEventSource",
    "LoadSnapshot",
    "LoraAdapter",
    "MediaItem",
    "ModelFacts",
    "PauseMode",
    "ProcessedMedia",
    "RankLoad",
    "RawTensor",
    "SamplingOptions",
    "SpecDecodeCounts",
    "StructuredOutputs",
    "TokenLogprob",
    "takes_direct_steps",
]
