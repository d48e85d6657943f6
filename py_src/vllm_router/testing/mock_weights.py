"""The mock engine's RL weight updates: the sequence as vLLM's workers keep it (start, one
update per chunk, finish; out of order refused with vLLM's messages), each update_info kept
for tests to read, and a failure on demand (`MOCK_FAILURE`)."""

from __future__ import annotations

from typing import Any

from ..engine import NO_DRAFT_MODEL, NO_WEIGHT_TRANSFER
from ..errors import EngineOperationFailed, InvalidRequest, NotConfigured

# An update_info key that makes the mock's UpdateWeights fail as a weight-transfer backend
# can fail, by what it leaves of the model (core/weight_updates.py): "refused" (nothing
# loaded), "part-loaded" (undone by a new update) or "lost" (the engine cannot restore it).
MOCK_FAILURE = "mock_failure"


def _mock_failure(kind: str) -> EngineOperationFailed:
    message = f"update_weights failed: the mock was told to fail ({kind})"
    if kind == "refused":
        return EngineOperationFailed(message, model_whole=True)
    if kind == "part-loaded":
        return EngineOperationFailed(message, model_whole=False, restartable=True)
    if kind == "lost":
        return EngineOperationFailed(message, model_whole=False)
    raise InvalidRequest(f"{MOCK_FAILURE} must be refused, part-loaded or lost, not {kind!r}")


class MockWeights:
    """One mock engine's weights: its version, the update in progress, every update taken."""

    def __init__(self, backend: str) -> None:
        self.backend = backend  # the mock's --mock-weight-transfer-backend ("": none)
        self.version = "default"
        # A weight update between start and finish (vLLM's workers keep the same flag).
        self.updating = False
        self.updates: list[dict[str, Any]] = []  # every update_info taken

    def init(self, init_info: dict[str, Any]) -> None:
        self._require()

    def start(self, *, draft: bool) -> None:
        self._require()
        if draft:
            raise NotConfigured(NO_DRAFT_MODEL)
        if self.updating:
            raise EngineOperationFailed(
                "start_weight_update failed: start_weight_update called while a weight "
                "update is already active. Call finish_weight_update first."
            )
        self.updating = True

    def update(self, update_info: dict[str, Any]) -> None:
        self._require()
        if not self.updating:
            raise EngineOperationFailed(
                "update_weights failed: start_weight_update must be called before update_weights."
            )
        failure = update_info.get(MOCK_FAILURE)
        if failure is not None:
            self.updating = False  # as vLLM's workers end an update that failed
            raise _mock_failure(str(failure))
        self.updates.append(update_info)

    def finish(self, version: str | None) -> None:
        self._require()
        if not self.updating:
            raise EngineOperationFailed(
                "finish_weight_update failed: finish_weight_update called without a matching "
                "start_weight_update."
            )
        self.updating = False
        if version is not None:
            self.version = version

    def _require(self) -> None:
        if not self.backend:
            raise NotConfigured(NO_WEIGHT_TRANSFER)
