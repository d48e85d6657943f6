"""FastOutputs (engine/vllm/fast_outputs.py) without vLLM: which engine outputs its loop takes
and which it leaves to vLLM's OutputProcessor, and the figures vLLM's `vllm:*` series read
from the steps it takes (generation tokens, inter-token latencies, the detokenizer's token
ids, weight-version spans), driven through `process_outputs` as vLLM's output handler
calls it. The real engine runs the same path in test_lean_outputs.py and
test_real_multi_token.py; these reach what a real engine seldom shows (every extra field,
a request vLLM already dropped, a weight-version change, the bulk latency counts)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from vllm_router.engine.vllm.fast_outputs import EXTRAS, FastOutputs, _fields_tested
from vllm_router.engine.vllm.lean import LeanStream
from vllm_router.engine.vllm.stats import BULK_LATENCIES


class Processor:
    """vLLM's OutputProcessor as FastOutputs sees it: its request states and its own
    `process_outputs`, which records what it was handed."""

    def __init__(self) -> None:
        self.request_states: dict[str, SimpleNamespace] = {}
        self.calls: list[tuple[list[str], float | None, Any, str | None]] = []

    def process_outputs(
        self,
        engine_core_outputs: list[Any],
        engine_core_timestamp: float | None = None,
        iteration_stats: Any = None,
        weight_version: str | None = None,
    ) -> Any:
        ids = [out.request_id for out in engine_core_outputs]
        self.calls.append((ids, engine_core_timestamp, iteration_stats, weight_version))
        return ("vllm's result", ids)


def request_state(last_token_ts: float = 10.0) -> SimpleNamespace:
    """A decoding request's RequestState: what LeanStream and FastOutputs read of it."""
    state = SimpleNamespace(
        stream_interval=1,
        detokenizer=SimpleNamespace(token_ids=[]),
        num_cached_tokens=0,
        queue=None,
        is_prefilling=False,
        stats=SimpleNamespace(num_generation_tokens=0, last_token_ts=last_token_ts),
        weight_version_starts=[],
    )

    def track_weight_version(version: str) -> None:  # vLLM's RequestState.track_weight_version
        starts = state.weight_version_starts
        if not starts or starts[-1][0] != version:
            starts.append((version, len(state.detokenizer.token_ids)))

    state.track_weight_version = track_weight_version
    return state


def iteration() -> SimpleNamespace:
    """vLLM's IterationStats for one engine step: the two figures a decode step adds to."""
    return SimpleNamespace(num_generation_tokens=0, inter_token_latencies_iter=[])


def core_output(request_id: str, token_ids: list[int], **extras: Any) -> SimpleNamespace:
    """An EngineCoreOutput: a plain step unless an extra field is set."""
    return SimpleNamespace(
        request_id=request_id, new_token_ids=token_ids, **{**dict.fromkeys(EXTRAS), **extras}
    )


class Registered:
    """A FastOutputs over a fake processor, with requests registered as the adapter does."""

    def __init__(self, *request_ids: str, bulk: bool = False, count_nans: bool = False) -> None:
        self.processor = Processor()
        self.fast = FastOutputs(self.processor, count_nans=count_nans, bulk_latencies=bulk)
        self.streams: dict[str, LeanStream] = {}
        for request_id in request_ids:
            self.add(request_id)

    def add(self, request_id: str) -> LeanStream:
        state = self.processor.request_states[request_id] = request_state()
        stream = self.streams[request_id] = LeanStream(
            request_id, state, detokenize=False, prompt_tokens=4
        )
        self.fast.register(request_id, stream)
        return stream

    def state(self, request_id: str) -> SimpleNamespace:
        return self.processor.request_states[request_id]

    def step(
        self,
        *outputs: SimpleNamespace,
        at: float = 10.5,
        stats: Any = None,
        weight_version: str | None = None,
    ) -> Any:
        """One engine step's outputs through the processor's (wrapped) process_outputs."""
        return self.processor.process_outputs(list(outputs), at, stats, weight_version)


async def taken(stream: LeanStream) -> list[int]:
    return (await asyncio.wait_for(stream.next_step(), 1)).token_ids


async def test_a_plain_step_is_counted_as_vllms_statistics_count_it_and_reaches_its_stream() -> (
    None
):
    run = Registered("a", "b")
    run.state("b").stats.last_token_ts = 10.25
    stats = iteration()
    result = run.step(core_output("a", [7, 8]), core_output("b", [9]), at=10.5, stats=stats)
    # Neither went to vLLM's path, which still runs (on nothing) and whose result is returned.
    assert run.processor.calls == [([], 10.5, stats, None)]
    assert result == ("vllm's result", [])
    assert stats.num_generation_tokens == 3
    assert stats.inter_token_latencies_iter == [0.5, 0.25]  # one per request, not per token
    a, b = run.state("a"), run.state("b")
    assert (a.stats.num_generation_tokens, a.stats.last_token_ts) == (2, 10.5)
    assert (b.stats.num_generation_tokens, b.stats.last_token_ts) == (1, 10.5)
    assert (a.detokenizer.token_ids, b.detokenizer.token_ids) == ([7, 8], [9])
    assert await taken(run.streams["a"]) == [7, 8]


def test_the_next_step_measures_its_latency_from_this_one() -> None:
    run = Registered("a")  # its last token at 10.0
    for at, latency in ((11.0, 1.0), (11.5, 0.5), (13.0, 1.5)):
        stats = iteration()
        run.step(core_output("a", [1]), at=at, stats=stats)
        assert stats.inter_token_latencies_iter == [latency]
    assert run.state("a").stats.num_generation_tokens == 3
    assert run.state("a").detokenizer.token_ids == [1, 1, 1]


@pytest.mark.parametrize("value", ["set", 0], ids=["set", "set though falsy"])
@pytest.mark.parametrize("field", EXTRAS)
def test_a_step_with_any_extra_field_is_vllms_whole(field: str, value: object) -> None:
    """Its first, its last (finish and stop reason), logprobs, events, KV transfer...: vLLM's
    own path, untouched by the fast loop (nothing counted twice)."""
    run = Registered("a", "b")
    stats = iteration()
    run.step(core_output("a", [5], **{field: value}), core_output("b", [6]), stats=stats)
    assert run.processor.calls == [(["a"], 10.5, stats, None)]
    assert (stats.num_generation_tokens, stats.inter_token_latencies_iter) == (1, [0.5])
    assert run.state("a").detokenizer.token_ids == []
    assert run.state("a").stats.num_generation_tokens == 0


@pytest.mark.vllm  # reads vLLM's EngineCoreOutput (no engine)
def test_the_extra_fields_are_the_loops_own_and_every_one_vllm_sets() -> None:
    """EXTRAS is read from the loop's condition (fast_outputs.py): every field of vLLM's
    EngineCoreOutput but the two a plain step carries is either in it or accounted for in
    compat.py, which checks the same at start."""
    from vllm.v1.engine import EngineCoreOutput

    from vllm_router.engine.vllm.compat import ENGINE_CORE_OUTPUT_READ

    fields = set(EngineCoreOutput.__struct_fields__)
    assert len(EXTRAS) == len(set(EXTRAS)) >= 14 and set(EXTRAS) <= fields
    assert fields - set(EXTRAS) <= set(ENGINE_CORE_OUTPUT_READ)
    assert not set(EXTRAS) & set(ENGINE_CORE_OUTPUT_READ)


def test_unregistered_prefilling_or_dropped_requests_are_vllms() -> None:
    run = Registered("a", "prefilling", "dropped")
    run.state("prefilling").is_prefilling = True
    del run.processor.request_states["dropped"]  # vLLM dropped it (aborted meanwhile)
    outputs = [core_output(r, [1]) for r in ("other", "prefilling", "dropped", "a")]
    stats = iteration()
    run.step(*outputs, stats=stats)
    assert run.processor.calls == [(["other", "prefilling", "dropped"], 10.5, stats, None)]
    assert stats.num_generation_tokens == 1


def test_an_unregistered_request_goes_back_to_vllms_path() -> None:
    run = Registered("a")
    run.fast.unregister("a")
    run.fast.unregister("never registered")  # an abort after the finish: no error
    run.step(core_output("a", [1]), stats=iteration())
    assert run.processor.calls[0][0] == ["a"]


def test_with_no_request_registered_every_argument_passes_through() -> None:
    run = Registered()
    stats = iteration()
    assert run.step(core_output("x", [1]), at=3.0, stats=stats, weight_version="v2") == (
        "vllm's result",
        ["x"],
    )
    assert run.processor.calls == [(["x"], 3.0, stats, "v2")]


def test_counting_nans_leaves_every_request_to_vllm() -> None:
    """VLLM_COMPUTE_NANS_IN_LOGITS: vLLM's path checks each output, so nothing registers."""
    run = Registered("a", count_nans=True)
    assert not run.fast.enabled
    run.step(core_output("a", [1]), stats=iteration())
    assert run.processor.calls[0][0] == ["a"]
    assert run.state("a").detokenizer.token_ids == []


async def test_without_iteration_stats_tokens_still_reach_the_stream_and_nothing_is_counted() -> (
    None
):
    """vLLM passes no IterationStats when its statistics are off (--disable-log-stats)."""
    run = Registered("a")
    run.step(core_output("a", [4, 5]), stats=None)
    assert run.processor.calls == [([], 10.5, None, None)]
    assert run.state("a").stats.num_generation_tokens == 0
    assert run.state("a").detokenizer.token_ids == [4, 5]
    assert await taken(run.streams["a"]) == [4, 5]


def test_bulk_latencies_are_counted_by_value_across_the_steps_chunks() -> None:
    """stats.BulkLatencies observes them: every request's latency, each value once with its
    count, in one dict per engine step even when vLLM hands the step over in chunks."""
    run = Registered("a", "b", "c", bulk=True)
    run.state("c").stats.last_token_ts = 10.25
    stats = iteration()
    run.step(core_output("a", [1]), core_output("c", [1]), at=10.5, stats=stats)
    run.step(core_output("b", [1, 2]), at=10.5, stats=stats)  # the same step's next chunk
    assert vars(stats)[BULK_LATENCIES] == {0.5: 2, 0.25: 1}
    assert stats.inter_token_latencies_iter == []  # not listed again one by one
    assert stats.num_generation_tokens == 4
    assert run.state("b").stats.last_token_ts == 10.5


def test_bulk_latencies_without_iteration_stats_count_nothing() -> None:
    run = Registered("a", bulk=True)
    run.step(core_output("a", [1]), stats=None)
    assert run.state("a").detokenizer.token_ids == [1]


def test_a_weight_version_change_starts_a_span_where_its_tokens_start() -> None:
    """vLLM's weight-version spans (RL weight updates): a span starts at the first token made
    with a new version; an empty step starts none."""
    run = Registered("a")
    run.step(core_output("a", [1, 2]), stats=iteration(), weight_version="v1")
    run.step(core_output("a", [3]), stats=iteration(), weight_version="v1")
    run.step(core_output("a", []), stats=iteration(), weight_version="v2")
    run.step(core_output("a", [4]), stats=iteration(), weight_version="v2")
    run.step(core_output("a", [5]), stats=iteration(), weight_version=None)
    assert run.state("a").weight_version_starts == [("v1", 0), ("v2", 3)]
    # vLLM's path is told the version too (for the requests it serves).
    assert [call[3] for call in run.processor.calls] == ["v1", "v1", "v2", "v2", None]


def test_the_fields_read_from_the_loop_each_send_a_step_to_vllm() -> None:
    """EXTRAS (what compat.py checks at start) is read from the loop's own condition once, at
    import; read again here, so that how it is read is tested too: every field it names, set,
    sends a step to vLLM's path, and the two fields a plain step carries are not among them."""
    fields = _fields_tested(FastOutputs._process_outputs)
    assert fields == EXTRAS
    assert len(fields) == len(set(fields)) >= 14
    assert not {"request_id", "new_token_ids"} & set(fields)
    for field in fields:
        run = Registered("a")
        run.step(core_output("a", [5], **{field: 0}), stats=iteration())
        assert run.processor.calls[0][0] == ["a"], field
