"""grpc.health.v1 as grpcio's health servicer serves it, with a Watch that says goodbye.

grpcio's servicer keeps every Watch open until the server's stop cancels it, so a router
or probe watching a worker that drains reads UNAVAILABLE ("Cancelling all calls"), a
failure, right after NOT_SERVING. Here `close_watches()` (called by the server just
before it stops) ends every Watch with OK once its latest status has been sent, as
vLLM's Rust front end does. Check, set and the graceful-shutdown rule are grpcio's.
"""

from __future__ import annotations

import asyncio
from typing import Any

from grpc_health.v1 import health, health_pb2

Status = Any  # health_pb2.HealthCheckResponse.ServingStatus values

# A name that answers SERVING for as long as the process serves at all (until its drain):
# a liveness probe's, which must not restart a worker for what the worker decides itself
# (a stall it may recover from, until --engine-stall-exit-seconds; a part-loaded model a
# trainer is replacing) but must find a process that answers nothing.
LIVENESS = "vllm_servicer.liveness"


class HealthService(health.aio.HealthServicer):
    def __init__(self) -> None:
        super().__init__()
        # What Watch reports: the same values grpcio's Check reads, kept here because
        # grpcio keeps its own map private.
        self._statuses: dict[str, Status] = {"": health_pb2.HealthCheckResponse.SERVING}
        self._changed = asyncio.Condition()
        self._closing = False
        self._final = False  # enter_graceful_shutdown: statuses never change again

    async def set(self, service: str, status: Status) -> None:
        await super().set(service, status)
        if not self._final:
            await self._publish({service: status})

    async def enter_graceful_shutdown(self) -> None:
        await super().enter_graceful_shutdown()
        if not self._final:
            self._final = True
            not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
            await self._publish(dict.fromkeys(self._statuses, not_serving))

    async def close_watches(self) -> None:
        """End every Watch with OK once it has sent the status it is due."""
        async with self._changed:
            self._closing = True
            self._changed.notify_all()

    async def _publish(self, statuses: dict[str, Status]) -> None:
        async with self._changed:
            self._statuses.update(statuses)
            self._changed.notify_all()

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: Any) -> None:
        unknown = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
        sent: Status | None = None
        async with self._changed:
            while True:
                status = self._statuses.get(request.service, unknown)
                if status != sent:
                    await context.write(health_pb2.HealthCheckResponse(status=status))
                    sent = status
                if self._closing:
                    return
                await self._changed.wait()
