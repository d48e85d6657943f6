"""The weight-update sequence, held by the worker: out-of-order steps never reach the engine,
and a model that a failed step left part-loaded never serves.

A trainer's update is Init (optional, any time no update is open) → Start → Update (each chunk) →
Finish. vLLM's workers keep a flag of their own, but they learn of a mistake only while
acting on it: a retried chunk reloads layers that were already rebuilt and fails half-way,
vLLM ends the update, and the model is left part-loaded; health stays SERVING, and the next
forward pass kills the engine core. So the worker keeps the sequence itself:

- a step out of order (Start while an update is open, Update or Finish with none open, Init
  during an update) is FAILED_PRECONDITION, and the engine is not called;
- a step the engine fails ends the update (vLLM's workers end it), and what it left of the
  model decides the rest (`EngineOperationFailed.model_whole` / `restartable`):
  - nothing was loaded (the file backend stages chunks and loads them all at Finish, so a
    refused chunk never touches the model): the worker serves on;
  - the model may be part-loaded and the engine can undo it: from that moment the worker
    is NOT_SERVING, new generation is refused with UNAVAILABLE saying why, and no forward
    pass runs on it; the trainer starts a new, complete update on the same worker, and
    health returns to SERVING once its Finish succeeds;
  - the model may be part-loaded and the engine cannot undo it (vLLM's own backends): the
    worker says so and exits for a restart, as for an engine death.

Every step runs inside `EngineOperations` (one at a time), so the phase a step checks is the
phase it acts on.
"""

from __future__ import annotations

import contextlib
import enum
import logging
from collections.abc import AsyncIterator

from ..errors import EngineOperationFailed, OutOfOrder
from .health import ServingState

logger = logging.getLogger(__name__)


class Step(enum.Enum):
    INIT = "InitWeightTransferEngine"
    START = "StartWeightUpdate"
    UPDATE = "UpdateWeights"
    FINISH = "FinishWeightUpdate"


class Phase(enum.Enum):
    IDLE = "idle"  # no update open
    OPEN = "open"  # started, not finished


class WeightUpdates:
    """The phase of this worker's weight update (see the module doc)."""

    def __init__(self, state: ServingState) -> None:
        self._state = state
        self.phase = Phase.IDLE
        # False from an update that left the model part-loaded to the next complete one.
        self.model_whole = True
        self._failure = ""  # what the engine said when the last update failed

    def check(self, step: Step) -> None:
        """Raise OutOfOrder when `step` does not follow from the phase."""
        if step in (Step.INIT, Step.START) and self.phase is Phase.OPEN:
            raise OutOfOrder(
                f"{step.value}: a weight update is open (started, not finished); send "
                "FinishWeightUpdate first"
            )
        if step in (Step.UPDATE, Step.FINISH) and self.phase is not Phase.OPEN:
            if self._failure:
                raise OutOfOrder(
                    f"{step.value}: no weight update is open: the last one failed "
                    f"({self._failure}); send StartWeightUpdate and every chunk again"
                )
            raise OutOfOrder(
                f"{step.value}: no weight update is open; send StartWeightUpdate first"
            )

    @contextlib.asynccontextmanager
    async def step(self, step: Step) -> AsyncIterator[None]:
        """Run one step's engine call in the body: checked first, the phase moved after."""
        self.check(step)
        try:
            yield
        except EngineOperationFailed as exc:
            if step is not Step.INIT:  # Init loads nothing, and leaves no update open
                self.phase = Phase.IDLE  # vLLM's workers end the update on a failure
                await self._failed(exc)
            raise
        if step is Step.START:
            self.phase = Phase.OPEN
        elif step is Step.FINISH:
            self.phase = Phase.IDLE
            self._failure = ""
            if not self.model_whole:
                self.model_whole = True
                logger.warning("A complete weight update succeeded: the model is whole again")
                await self._state.model_whole()

    async def _failed(self, exc: EngineOperationFailed) -> None:
        self._failure = exc.message
        if exc.model_whole:  # the model as it was (whole or not): the trainer starts again
            return
        self.model_whole = False
        if not exc.restartable:
            logger.error(
                "A weight update failed part-way (%s) and this engine cannot restore its "
                "model: exiting for a restart",
                exc.message,
            )
            await self._state.engine_died(
                exc.message,
                "a weight update failed part-way and this engine cannot restore its model; "
                "the worker exits for a restart (retry on another worker)",
            )
            return
        logger.error(
            "A weight update failed part-way (%s): the model is not whole; NOT_SERVING until "
            "a new update (StartWeightUpdate, every chunk, FinishWeightUpdate) succeeds",
            exc.message,
        )
        await self._state.model_unfit(
            "a weight update failed part-way and the model is not whole; it serves again "
            f"once a complete update succeeds (the engine said: {exc.message})"
        )
