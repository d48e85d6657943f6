"""The serving core: what every gRPC contract on one server shares.

`ServingState` is the one truth about whether this worker serves; `RequestTable`
owns requests in flight (one request-id space, admission limits, drain, the stall
watchdog, abort-all) and hands out their steps already counted; `ServingCore` bundles
them with the tokenizer files and metrics for the contracts' servicers
(`ContractServicer`, `handles_errors`). The core knows the engine protocol, never a
gRPC contract.
"""

from .flight import Flight
from .health import ServingState, ServingStatus
from .media_admission import MediaRules
from .metrics import ServicerMetrics
from .requests import RequestTable
from .servicer import (
    ContractServicer,
    Malformed,
    ServingCore,
    abort_with,
    errors_mapped,
    failure_status,
    handles_errors,
)

__all__ = [
    "ContractServicer",
    "Flight",
    "Malformed",
    "MediaRules",
    "RequestTable",
    "ServicerMetrics",
    "ServingCore",
    "ServingState",
    "ServingStatus",
    "abort_with",
    "errors_mapped",
    "failure_status",
    "handles_errors",
]
