"""The serving core: what every gRPC contract on one server shares.

`ServingState` is the one truth about whether this worker serves; `RequestTable`
owns requests in flight (one request-id space, admission limits, drain, the stall
watchdog, abort-all) and hands out their steps already counted; `ServingCore` bundles
them with the tokenizer files and metrics for the contracts' servicers
(`ContractServicer`, `handles_errors`). The core knows the engine protocol, never a
gRPC contract.
"""

from .health import ServingState, ServingStatus
from .metrics import ServicerMetrics
from .requests import Flight, RequestTable
from .servicer import (
    ContractServicer,
    Malformed,
    ServingCore,
    abort_with,
    failure_status,
    handles_errors,
)

__all__ = [
    "ContractServicer",
    "Flight",
    "Malformed",
    "RequestTable",
    "ServicerMetrics",
    "ServingCore",
    "ServingState",
    "ServingStatus",
    "abort_with",
    "failure_status",
    "handles_errors",
]
