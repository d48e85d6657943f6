"""The vLLM compatibility layer on the real engine: every touch point matches this vLLM; one that
does not turns its feature off with one log line and the worker serves through vLLM's public
path; a failure inside the lean output path fails that request alone (fault injection)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from output_paths import counting_paths

from vllm_router.engine import GenerationRequest, LoadSnapshot, SamplingOptions
from vllm_router.engine.vllm import VllmEngine, compat
from vllm_router.engine.vllm.lean import LeanStream
from vllm_router.engine.vllm.stats import LoadBoard

from harness import Harness, collect_stream, real_engine_idle, request, wait_until

pytestmark = pytest.mark.vllm

PROMPT = [7, 8, 9, 10]
GREEDY = {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True}


def generation(request_id: str) -> GenerationRequest:
    return GenerationRequest(
        request_id=request_id,
        prompt_token_ids=PROMPT,
        prompt_text=None,
        sampling=SamplingOptions(**GREEDY),  # type: ignore[arg-type]
    )


async def token_ids(engine: Any, request_id: str) -> list[int]:
    return [t async for step in engine.generate(generation(request_id)) for t in step.token_ids]


async def test_every_touch_point_matches_the_installed_vllm(real: Harness) -> None:
    import vllm

    assert vllm.__version__.split("+")[0] in compat.CHECKED_VERSIONS
    assert real.engine.features == {point.feature for point in compat.TOUCH_POINTS}
    assert real.engine.lean_outputs


def test_a_mismatch_or_a_failing_check_turns_only_its_feature_off(
    caplog: pytest.LogCaptureFixture,
) -> None:
    points = (
        compat.TouchPoint("fake.one", "feature A", "the public path", lambda llm: "renamed"),
        compat.TouchPoint("fake.two", "feature B", "the public path", lambda llm: str(1 / 0)),
        compat.TouchPoint("fake.three", "feature C", "the public path", lambda llm: None),
    )
    with caplog.at_level(logging.WARNING, logger=compat.__name__):
        features = compat.check_touch_points(object(), points)
    assert features == {"feature C"}
    lines = [r.getMessage() for r in caplog.records if "touch point" in r.getMessage()]
    assert len(lines) == 2
    assert "fake.one does not match (renamed): feature A off, the public path" in lines[0]
    assert "ZeroDivisionError" in lines[1]


def test_unmatched_load_figures_are_reported_unknown_not_idle() -> None:
    """LOAD_FIGURES' fallback: the board publishes nothing it read from a vLLM whose stat
    logger or SchedulerStats do not match, and forgets what it had (the engine's start)."""
    board = LoadBoard(2)
    board.update(0, 3, 1, 0.5)
    assert board.ranks()[0].measured_at is not None
    board.unmeasured()
    board.update(1, 2, 2, 0.25)
    assert all(rank.measured_at is None for rank in board.ranks())
    assert board.snapshot == LoadSnapshot()


async def test_a_changed_vllm_signature_falls_back_to_the_public_path(
    real: Harness, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from vllm.v1.engine.output_processor import RequestState

    expected = await token_ids(real.engine, "compat-reference")
    original = RequestState.make_request_output

    def renamed(self: Any, new_token_ids: Any, finish: Any, stop: Any) -> Any:
        raise AssertionError("never called: the lean path is off")

    monkeypatch.setattr(RequestState, "make_request_output", renamed)
    with caplog.at_level(logging.WARNING, logger=compat.__name__):
        fallback = VllmEngine(real.engine.llm, LoadBoard())
    monkeypatch.setattr(RequestState, "make_request_output", original)
    mismatches = [r.getMessage() for r in caplog.records if "touch point" in r.getMessage()]
    assert len(mismatches) == 1 and "RequestState.make_request_output" in mismatches[0]
    assert not fallback.lean_outputs and compat.LEAN_OUTPUTS not in fallback.features
    # The other features still run, and the request takes AsyncLLM.generate: same tokens.
    assert compat.RENDER in fallback.features
    with counting_paths() as counts:
        assert await token_ids(fallback, "compat-fallback") == expected
    assert counts.lean_streams == 0


async def test_the_public_fallbacks_give_the_same_answers(real: Harness) -> None:
    """Rendering, tokenization and the engine's series through their fallbacks."""
    expected = await token_ids(real.engine, "fallback-reference")
    text_ids = await real.engine.tokenize("Hello there")
    public = VllmEngine(real.engine.llm, LoadBoard())
    public.features = frozenset({compat.LEAN_OUTPUTS})  # as if the rest had not matched
    assert await token_ids(public, "fallback-public") == expected
    assert await public.tokenize("Hello there") == text_ids


async def _stream_outcome(harness: Harness, request_id: str) -> list[int] | str:
    req = request(PROMPT, request_id=request_id, **GREEDY)
    try:
        messages = await collect_stream(harness.stub, req)
    except grpc.aio.AioRpcError as err:
        return err.code().name
    return [t for m in messages for t in m.token_ids]


async def test_a_failing_output_handler_fails_one_request_not_the_engine(
    real: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    expected = await _stream_outcome(real, "handler-reference")
    assert isinstance(expected, list) and len(expected) == GREEDY["max_tokens"]
    take = LeanStream._take
    calls: dict[str, int] = {}

    def failing_take(self: LeanStream, *args: Any) -> None:
        calls[self._request_id] = calls.get(self._request_id, 0) + 1
        if self._request_id == "victim" and calls["victim"] == 3:
            raise KeyError("injected fault")
        take(self, *args)

    monkeypatch.setattr(LeanStream, "_take", failing_take)
    ids = ["victim", *(f"bystander-{i}" for i in range(4))]
    outcomes = await asyncio.gather(*(_stream_outcome(real, rid) for rid in ids))
    assert outcomes[0] == "INTERNAL"
    assert outcomes[1:] == [expected] * 4  # every other stream, token for token
    assert not real.engine.llm.errored
    await wait_until(lambda: real_engine_idle(real), what="the failed request aborted")
    health = health_pb2_grpc.HealthStub(real.channel)
    reply = await health.Check(health_pb2.HealthCheckRequest())
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    monkeypatch.setattr(LeanStream, "_take", take)
    assert await _stream_outcome(real, "after-the-fault") == expected


async def test_a_failing_takeover_aborts_its_request_in_the_engine(
    real: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    expected = await _stream_outcome(real, "takeover-reference")
    init = LeanStream.__init__

    def failing_init(self: LeanStream, request_id: str, *args: Any, **kwargs: Any) -> None:
        if request_id == "taken-over":
            raise RuntimeError("injected takeover fault")
        init(self, request_id, *args, **kwargs)

    monkeypatch.setattr(LeanStream, "__init__", failing_init)
    outcomes = await asyncio.gather(
        _stream_outcome(real, "taken-over"), _stream_outcome(real, "beside-it")
    )
    assert outcomes == ["INTERNAL", expected]
    await wait_until(lambda: real_engine_idle(real), what="the orphan request aborted")
    assert not real.engine.llm.output_processor.request_states
    assert not real.engine.llm.errored
