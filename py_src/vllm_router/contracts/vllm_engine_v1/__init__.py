"""Our own contract, `vllm.engine.v1.VllmEngine` (proto/vllm_engine.proto)."""
