"""The contracts a server mounts: one entry each, the only place that names them.

A contract is a package under `vllm_router.contracts` plus one `ContractEntry` here:
the service it serves (its health and reflection name), the servicer built over the
serving core, the generated function that adds it to a gRPC server, and whether the
server's configuration turns it on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc

from ..contracts.vllm_engine_v1.servicer import SERVICE_NAME as ENGINE_V1_SERVICE
from ..contracts.vllm_engine_v1.servicer import VllmEngineServicer
from ..contracts.vllm_grpc_engine.servicer import SERVICE_NAME as VLLM_GRPC_SERVICE
from ..contracts.vllm_grpc_engine.servicer import VllmGrpcServicer
from ..contracts.vllm_native.servicer import (
    CONTROL_SERVICE,
    INFERENCE_SERVICE,
    NativeControlServicer,
    NativeInferenceServicer,
)
from ..core import ContractServicer
from ..proto import vllm_engine_pb2_grpc as pb_grpc
from ..proto import vllm_native_pb2_grpc as npb_grpc
from .config import ServerConfig


@dataclass(frozen=True)
class ContractEntry:
    # Full service name: routed by the server, answered by grpc.health.v1, listed by reflection.
    service_name: str
    servicer: type[ContractServicer]  # built over the serving core
    add_to_server: Callable[[Any, grpc.aio.Server], None]
    enabled: Callable[[ServerConfig], bool] = lambda config: True


CONTRACTS: tuple[ContractEntry, ...] = (
    ContractEntry(ENGINE_V1_SERVICE, VllmEngineServicer, pb_grpc.add_VllmEngineServicer_to_server),
    ContractEntry(
        VLLM_GRPC_SERVICE,
        VllmGrpcServicer,
        vpb_grpc.add_VllmEngineServicer_to_server,
        enabled=lambda config: config.vllm_grpc,
    ),
    # vLLM's native contract: two services, one plug-in (what vllm-router speaks).
    ContractEntry(
        INFERENCE_SERVICE,
        NativeInferenceServicer,
        npb_grpc.add_InferenceServicer_to_server,
        enabled=lambda config: config.vllm_native,
    ),
    ContractEntry(
        CONTROL_SERVICE,
        NativeControlServicer,
        npb_grpc.add_ControlServicer_to_server,
        enabled=lambda config: config.vllm_native,
    ),
)


def enabled_contracts(config: ServerConfig) -> tuple[ContractEntry, ...]:
    return tuple(entry for entry in CONTRACTS if entry.enabled(config))


def control_methods(contracts: tuple[ContractEntry, ...]) -> frozenset[str]:
    """The full method names ('/package.Service/Method') of the mounted contracts' control
    RPCs: what the control key guards (server/security.py)."""
    return frozenset(
        f"/{entry.service_name}/{rpc}" for entry in contracts for rpc in entry.servicer.control_rpcs
    )
