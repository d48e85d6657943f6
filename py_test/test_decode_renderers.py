"""Every contract's direct-step renderer (what a direct send renders, core/flight.py)
makes the message its step renderer makes of the same plain decode step, byte for byte:
a stream's renderer renders one message again for every step, so each step in a row must
read as its own (nothing left of the step before, more tokens or fewer)."""

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


# Steps in a row on one stream's renderer: more tokens, then fewer, then another sample.
IN_A_ROW = [DECODES[1], DECODES[0], DECODES[2], DECODES[1], DECODES[0]]


def test_vllm_engine_v1() -> None:
    render = v1.direct_step_renderer("req-1")
    for decode in IN_A_ROW:
        made = render(*decode)
        expected = v1.stream_message("req-1", plain(*decode), None)
        assert made.SerializeToString() == expected.SerializeToString() and made == expected
        assert made.usage.completion_tokens == decode[2] and list(made.token_ids) == decode[0]


def test_vllm_grpc_engine() -> None:
    render = official.direct_step_renderer()
    for decode in IN_A_ROW:
        made = render(*decode)
        expected = official.chunk(plain(*decode), 0, None, 0)
        assert made.SerializeToString() == expected.SerializeToString() and made == expected
        assert made.chunk.completion_tokens == len(decode[0])


@pytest.mark.parametrize("flags", list(itertools.product((False, True), repeat=5)))
def test_vllm_native(flags: tuple[bool, ...]) -> None:
    wanted = native.Wanted(*flags)
    render = native.direct_step_renderer(wanted)
    for decode in IN_A_ROW:
        made = render(*decode)
        expected = native.sequence_output(plain(*decode), wanted, frozenset({2}))
        assert made.SerializeToString() == expected.SerializeToString() and made == expected
        assert made.outputs.num_tokens == len(decode[0])
        assert list(made.outputs.token_ids) == (decode[0] if wanted.token_ids else [])
