"""Unset sampling fields follow the checkpoint's generation_config.json, set ones override."""

from __future__ import annotations

import pytest

from vllm_router.proto import vllm_engine_pb2 as pb

from conftest import RealHarness

pytestmark = pytest.mark.vllm


def _req(**sampling: object) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        prompt_token_ids=[7, 8, 9],
        sampling_params=pb.SamplingParams(seed=99, max_tokens=40, ignore_eos=True, **sampling),
    )


async def _tokens(harness: RealHarness, **sampling: object) -> list[int]:
    return list((await harness.stub.Generate(_req(**sampling))).output_token_ids)


async def test_unset_temperature_uses_vllm_default_without_generation_config(
    real: RealHarness,
) -> None:
    assert await _tokens(real) == await _tokens(real, temperature=1.0)
    assert await _tokens(real) != await _tokens(real, temperature=0.05)


async def test_unset_temperature_follows_generation_config(
    real: RealHarness, real_with_generation_defaults: RealHarness
) -> None:
    harness = real_with_generation_defaults
    unset = await _tokens(harness)
    assert unset == await _tokens(harness, temperature=0.05)
    assert unset != await _tokens(harness, temperature=1.0)
    # Same weights in both checkpoints: a set temperature wins over the model default.
    assert await _tokens(harness, temperature=1.0) == await _tokens(real, temperature=1.0)
