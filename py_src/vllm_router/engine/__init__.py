"""Engines behind the servicers: the protocol, its neutral types, and the adapters.

`vllm.py` adapts vLLM's AsyncLLM (imported lazily); the mock lives in
`vllm_router.testing`. Nothing in this package imports gRPC contracts.
"""

from .protocol import AsyncEngine
from .types import (
    NEUTRAL_DEFAULT,
    EngineStep,
    FinishReason,
    GenerationRequest,
    LoadSnapshot,
    ModelFacts,
    SamplingOptions,
    TokenLogprob,
)

__all__ = [
    "NEUTRAL_DEFAULT",
    "AsyncEngine",
    "EngineStep",
    "FinishReason",
    "GenerationRequest",
    "LoadSnapshot",
    "ModelFacts",
    "SamplingOptions",
    "TokenLogprob",
]
