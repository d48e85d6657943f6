"""Unset sampling fields follow the checkpoint's generation_config.json, set ones override."""

from __future__ import annotations

from typing import Any

import pytest

from harness import Harness, request

pytestmark = pytest.mark.vllm


async def _tokens(harness: Harness, **sampling: Any) -> list[int]:
    return list(
        (
            await harness.stub.Generate(
                request([7, 8, 9], seed=99, max_tokens=40, ignore_eos=True, **sampling)
            )
        ).output_token_ids
    )


async def test_unset_temperature_uses_vllm_default_without_generation_config(
    real: Harness,
) -> None:
    assert await _tokens(real) == await _tokens(real, temperature=1.0)
    assert await _tokens(real) != await _tokens(real, temperature=0.05)


async def test_unset_temperature_follows_generation_config(
    real: Harness, real_with_generation_defaults: Harness
) -> None:
    harness = real_with_generation_defaults
    unset = await _tokens(harness)
    assert unset == await _tokens(harness, temperature=0.05)
    assert unset != await _tokens(harness, temperature=1.0)
    # Same weights in both checkpoints: a set temperature wins over the model default.
    assert await _tokens(harness, temperature=1.0) == await _tokens(real, temperature=1.0)
