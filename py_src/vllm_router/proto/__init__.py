"""Protobuf and gRPC stubs for vllm.engine.v1, generated from proto/ at install time."""

try:
    from . import vllm_engine_pb2, vllm_engine_pb2_grpc
except ImportError as exc:  # pragma: no cover - exercised by the build test
    raise ImportError(
        "vllm_router's generated gRPC stubs are missing (they are built from "
        "proto/vllm_engine.proto at install time, never checked in). Reinstall the "
        "package: `pip install .` or `pip install -e .` from the source tree."
    ) from exc

__all__ = ["vllm_engine_pb2", "vllm_engine_pb2_grpc"]
