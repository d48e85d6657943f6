"""Runtime state shared by every gRPC contract on one server.

`ServingState` is the one truth about whether this worker serves; `RequestTable`
owns requests in flight (one request-id space, admission limits, drain, the stall
watchdog, abort-all). Both know the engine protocol, not gRPC contracts.
"""

from .health import ServingState, ServingStatus
from .metrics import ServicerMetrics
from .requests import Flight, RequestTable

__all__ = ["Flight", "RequestTable", "ServicerMetrics", "ServingState", "ServingStatus"]
