"""Exit 0 when a gRPC server at ADDRESS reports SERVING on grpc.health.v1, else 1.

python -m vllm_router.testing.wait_serving HOST:PORT
"""

from __future__ import annotations

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def serving(address: str, timeout: float = 2.0) -> bool:
    try:
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=timeout
            )
    except grpc.RpcError:
        return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


if __name__ == "__main__":
    sys.exit(0 if len(sys.argv) == 2 and serving(sys.argv[1]) else 1)
