"""The one rule for SERVING / NOT_SERVING, asked by every health surface and by admission."""

from __future__ import annotations

from dataclasses import dataclass

from ..engine import AsyncEngine
from ..errors import EngineUnavailable

ENGINE_DEAD = "the engine is dead; this worker cannot serve (retry on another worker)"
DRAINING = "server is draining (shutting down); retry on another worker"


@dataclass(frozen=True, slots=True)
class ServingStatus:
    serving: bool
    # Why not, when not serving.
    reason: str = ""


SERVING = ServingStatus(serving=True)


class ServingState:
    """Whether this worker serves: the engine is alive and the server is not draining.

    The custom HealthCheck RPC, grpc.health.v1 (through the server's watcher) and
    request admission all ask `status()`; nothing else decides.
    """

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine
        self._draining = False

    def start_draining(self) -> None:
        self._draining = True

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def engine_dead(self) -> bool:
        return self._engine.errored

    async def status(self) -> ServingStatus:
        problem = await self._engine_problem()
        if problem is not None:
            return ServingStatus(False, problem)
        if self._draining:
            return ServingStatus(False, DRAINING)
        return SERVING

    async def require_serving(self) -> None:
        """Raise EngineUnavailable (with the reason) unless serving: for new generation."""
        status = await self.status()
        if not status.serving:
            raise EngineUnavailable(status.reason)

    async def require_engine(self) -> None:
        """Raise EngineUnavailable if the engine is dead: for RPCs that work while draining."""
        problem = await self._engine_problem()
        if problem is not None:
            raise EngineUnavailable(problem)

    async def _engine_problem(self) -> str | None:
        if self._engine.errored:
            return ENGINE_DEAD
        try:
            await self._engine.check_health()
        except EngineUnavailable as exc:
            return exc.message
        return None
