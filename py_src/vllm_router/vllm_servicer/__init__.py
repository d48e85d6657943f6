"""The seed's public names, kept working: `vllm_router.vllm_servicer.VllmEngineServicer`
(our contract's servicer, now in `contracts.vllm_engine_v1`) and
`python -m vllm_router.vllm_servicer` (the `vllm-servicer` command, see `__main__`)."""

from ..contracts.vllm_engine_v1.servicer import SERVICE_NAME, VllmEngineServicer

__all__ = ["SERVICE_NAME", "VllmEngineServicer"]
