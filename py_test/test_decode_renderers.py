"""Every contract's prebuilt decode renderer (what a direct send renders, core/flight.py)
makes the message its step renderer makes of the same plain decode step, byte for byte."""

from __future__ import annotations

import itertools

import pytest

import vllm_router.contracts.vllm_engine_v1.responses as v1
import vllm_router.contracts.vllm_grpc_engine.responses as official
import vllm_router.contracts.vllm_native.responses as native
from vllm_router.engine import EngineStep

# The step rendered before (a request's first, with its usage) and the plain decode steps
# that may follow it: one token, several (a step merged under back-pressure), and on
# another sample's index.
LAST = EngineStep(
    token_ids=[5], text="He", finished=False, prompt_tokens=7, completion_tokens=1,
    cached_tokens=3, index=0,
)  # fmt: skip
DECODES = [([9], LAST, 2), ([9, 10, 11], LAST, 4), ([4], EngineStep(
    token_ids=[1], text="", finished=False, prompt_tokens=7, completion_tokens=6,
    cached_tokens=0, index=2), 7)]  # fmt: skip


def plain(token_ids: list[int], last: EngineStep, completion_tokens: int) -> EngineStep:
    return EngineStep(
        token_ids=token_ids, text="", finished=False, prompt_tokens=last.prompt_tokens,
        completion_tokens=completion_tokens, cached_tokens=last.cached_tokens, index=last.index,
    )  # fmt: skip


@pytest.mark.parametrize("decode", DECODES)
def test_vllm_engine_v1(decode: tuple[list[int], EngineStep, int]) -> None:
    made = v1.decode_message("req-1", *decode)
    assert made == v1.stream_message("req-1", plain(*decode), None)
    assert made.usage.completion_tokens == decode[2] and list(made.token_ids) == decode[0]


@pytest.mark.parametrize("decode", DECODES)
def test_vllm_grpc_engine(decode: tuple[list[int], EngineStep, int]) -> None:
    made = official.decode_chunk(*decode)
    assert made == official.chunk(plain(*decode), 0, None, 0)
    assert made.chunk.completion_tokens == len(decode[0])


@pytest.mark.parametrize("flags", list(itertools.product((False, True), repeat=5)))
@pytest.mark.parametrize("decode", DECODES)
def test_vllm_native(flags: tuple[bool, ...], decode: tuple[list[int], EngineStep, int]) -> None:
    wanted = native.Wanted(*flags)
    made = native.decode_output(wanted)(*decode)
    assert made == native.sequence_output(plain(*decode), wanted, frozenset({2}))
    assert made.outputs.num_tokens == len(decode[0])
    assert list(made.outputs.token_ids) == (decode[0] if wanted.token_ids else [])
