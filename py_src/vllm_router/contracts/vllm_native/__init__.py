"""vLLM's native contract, `vllm.Inference` + `vllm.Control` (proto/vllm_native.proto).

What vLLM's Rust front end (`vllm-rs --grpc-port`) serves and the vllm-project's own
router (`vllm-router`) speaks: on this contract vllm-rs's behaviour is the specification.
"""
