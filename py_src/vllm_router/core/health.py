"""The one rule for SERVING / NOT_SERVING, asked by every health surface and by admission."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from ..engine import AsyncEngine
from ..errors import EngineUnavailable

logger = logging.getLogger(__name__)

ENGINE_DEAD = "the engine is dead; this worker cannot serve (retry on another worker)"
DRAINING = "server is draining (shutting down); retry on another worker"


@dataclass(frozen=True, slots=True)
class ServingStatus:
    serving: bool
    # Why not, when not serving.
    reason: str = ""


SERVING = ServingStatus(serving=True)


class ServingState:
    """Whether this worker serves: the engine is alive and in rotation, its model is whole
    (no weight update failed part-way), and the server is not draining.

    The contracts' HealthCheck RPCs, grpc.health.v1 (through the server's watcher) and
    request admission all ask `status()`; nothing else decides. Engine death is final:
    the first path that sees it (a stream, an RPC, a health check, the poll) calls
    `engine_died`, which runs the listeners (the server publishes NOT_SERVING on
    grpc.health.v1) before that path answers its own client. A stalled engine is out of
    rotation until it steps again (core.progress): the listeners hear both changes.
    """

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine
        self._draining = False
        self._dead: str | None = None
        self._out_of_rotation: str | None = None
        # The model is not whole (a weight update failed part-way): no forward pass on it.
        self._unfit: str | None = None
        self._listeners: list[Callable[[], Awaitable[None]]] = []
        self._death_announced = asyncio.Event()

    def on_change(self, listener: Callable[[], Awaitable[None]]) -> None:
        """`listener` runs when the engine dies, leaves rotation or rejoins it."""
        self._listeners.append(listener)

    async def leave_rotation(self, reason: str) -> None:
        """The engine is stalled (`reason`: what health and refused requests say); the
        requests in flight are left alone."""
        self._out_of_rotation = reason
        await self._announce()

    async def rejoin_rotation(self) -> None:
        self._out_of_rotation = None
        await self._announce()

    async def model_unfit(self, reason: str) -> None:
        """The served model is not whole (`reason`: what health and refused requests say):
        new generation is refused until `model_whole`; control RPCs still run."""
        self._unfit = reason
        await self._announce()

    async def model_whole(self) -> None:
        if self._unfit is not None:
            self._unfit = None
            await self._announce()

    @property
    def unfit(self) -> str | None:
        """Why the model is not whole, or None."""
        return self._unfit

    async def _announce(self) -> None:
        for listener in self._listeners:
            await listener()

    async def engine_died(self, detail: str, reason: str = ENGINE_DEAD) -> None:
        """Record the engine's death (`reason`: what health and refused requests say);
        returns once every listener has heard of it (every caller waits for that, not
        only the first)."""
        if self._dead is None:
            self._dead = reason
            logger.error("Engine died (%s): this worker is NOT_SERVING from now on", detail)
            try:
                await self._announce()
            finally:
                self._death_announced.set()
        await self._death_announced.wait()

    def start_draining(self) -> None:
        self._draining = True

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def engine_dead(self) -> bool:
        return self._dead is not None or self._engine.errored

    async def status(self) -> ServingStatus:
        problem = await self._engine_problem()
        if problem is not None:
            return ServingStatus(False, problem)
        if self._unfit is not None:
            return ServingStatus(False, self._unfit)
        if self._out_of_rotation is not None:
            return ServingStatus(False, self._out_of_rotation)
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
        if self._dead is not None:
            return self._dead
        if self._engine.errored:
            await self.engine_died("the engine reports itself errored")
            return self._dead
        try:
            await self._engine.check_health()
        except EngineUnavailable as exc:
            await self.engine_died(exc.message)
            return self._dead
        return None
