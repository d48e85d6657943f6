"""vLLM's official contract, `vllm.grpc.engine.VllmEngine` (messages from smg-grpc-proto).

What `vllm serve --grpc` serves and the SMG router speaks: on this contract vLLM's own
`--grpc` server's behaviour is the specification.
"""
