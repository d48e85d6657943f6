"""vLLM's official gRPC contract (vllm.grpc.engine, from the smg-grpc-proto package).

The second face of the same worker: its servicer and pure conversions, sharing the
engine, request table, health and error mapping with vllm.engine.v1.
"""
