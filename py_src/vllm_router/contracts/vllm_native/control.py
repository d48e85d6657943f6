"""vllm.Control's requests, as vllm-rs reads them: pause and sleep modes and levels, the
weight-transfer RPCs' JSON, weight versions. Pure conversions: the servicer calls the engine."""

from __future__ import annotations

import json
from typing import Any

from ...engine import ModelFacts, PauseMode
from ...errors import InvalidRequest, NotConfigured
from ...proto import vllm_native_pb2 as npb

_PAUSE_MODES: dict[int, PauseMode] = {
    npb.PAUSE_MODE_UNSPECIFIED: "abort",
    npb.PAUSE_MODE_ABORT: "abort",
    npb.PAUSE_MODE_WAIT: "wait",
    npb.PAUSE_MODE_KEEP: "keep",
}


def pause_mode(mode: int) -> PauseMode:
    """A PauseMode value (unspecified: abort, as vllm-rs)."""
    found = _PAUSE_MODES.get(mode)
    if found is None:
        raise InvalidRequest(f"mode {mode} is not a PauseMode")
    return found


def pause(request: npb.PauseGenerationRequest) -> tuple[PauseMode, bool]:
    """(mode, clear_cache): clear_cache defaults to true."""
    clear_cache = request.clear_cache if request.HasField("clear_cache") else True
    return pause_mode(request.mode), clear_cache


SLEEP_LEVELS = (0, 1, 2)


def sleep(request: npb.SleepRequest, facts: ModelFacts) -> tuple[int, PauseMode, bool]:
    """(level, mode, reset_connector), checked in vllm-rs 0.34's order: sleep mode, then the
    pause mode, then the level (1 when absent); reset_connector is true when absent."""
    if not facts.sleep_mode:
        raise NotConfigured(
            "sleep mode is not enabled on this engine (start it with --enable-sleep-mode, "
            "on a platform that supports it)"
        )
    mode = pause_mode(request.mode)
    level = request.level if request.HasField("level") else 1
    if level not in SLEEP_LEVELS:
        expected = ", ".join(map(str, SLEEP_LEVELS))
        raise InvalidRequest(f"invalid sleep level `{level}`; expected one of: {expected}")
    reset = request.reset_connector if request.HasField("reset_connector") else True
    return level, mode, reset


def json_object(data: bytes, field: str) -> dict[str, Any]:
    """A weight-transfer RPC's JSON bytes, which must hold an object (as vllm-rs reads them:
    the per-worker list form vLLM's HTTP route takes is not one)."""
    try:
        value = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"{field} must contain valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise InvalidRequest(f"{field} must contain a JSON object")
    return value


def weight_version(version: str) -> str:
    """A weight version a trainer sets: any text but a blank one (kept as sent)."""
    if not version.strip():
        raise InvalidRequest("weight_version must not be empty")
    return version
