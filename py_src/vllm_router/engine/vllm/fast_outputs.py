"""Token-only decode steps without vLLM's per-request output work (one loop, bulk stats).

vLLM's `OutputProcessor.process_outputs` runs, for every request and every engine step,
a stats update through three call layers, the detokenizer, the logprobs processor and
`make_request_output`. A request a router sends (token ids out, no stop strings, no
logprobs, one sample: a `LeanStream` without detokenization) needs none of that on an
ordinary decode step, only its new token ids and the two figures vLLM's statistics take
from such a step (generation tokens, one inter-token latency).

`FastOutputs` wraps the output processor's `process_outputs` once per engine: the
registered requests' plain decode steps are handled in one tight loop (the same figures
added to the same `IterationStats` and `RequestStateStats`, the inter-token latencies
counted by value for stats.BulkLatencies, so every `vllm:*` series counts exactly what
vLLM's path would), and everything else — other requests, and any
step of a registered one that carries more than new tokens (its first, its last, engine
events, prefill or KV-transfer data, a stop reason) — goes to vLLM's own method
unchanged. Aborts, finishes, tracing (at the finish), engine death and stop token ids
(applied in the engine core) therefore stay vLLM's. A step's new tokens go to the
request's `LeanStream` (`LeanStream.plain_step`), which gives them direct to its
consumer's receiver when the rule allows (engine/direct.py): no task wakes for them.
Which steps go direct is the rule's to say, not this loop's: it only sends there the
plain steps, those that carry nothing but new tokens.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from .lean import LeanStream
from .stats import BULK_LATENCIES

logger = logging.getLogger(__name__)

# EngineCoreOutput fields that are None on a plain step; any of them set sends the step
# to vLLM's path (compat.py checks that the struct still has every one).
EXTRAS = (
    "new_logprobs", "new_prompt_logprobs_tensors", "pooling_output", "finish_reason",
    "stop_reason", "events", "kv_transfer_params", "ec_transfer_params", "prefill_stats",
    "routed_experts", "mm_cache_miss_hashes", "new_sampling_mask", "spec_decode_metrics",
    "prompt_token_id_logprobs",
)  # fmt: skip


def _extras_check(fields: tuple[str, ...]) -> Callable[[Any], bool]:
    """`out.a is not None or out.b is not None or ...` over `fields`, compiled once: the
    list above is the only one, and the check runs per request per step, where a loop over
    names or an attrgetter tuple costs about half as much again."""
    assert all(name.isidentifier() for name in fields)
    test = " or ".join(f"out.{name} is not None" for name in fields)
    check: Callable[[Any], bool] = eval(f"lambda out: {test}")
    return check


# Whether an EngineCoreOutput carries more than new tokens (not a plain step).
carries_extras = _extras_check(EXTRAS)


class FastOutputs:
    """The output processor's decode steps for registered token-only requests."""

    def __init__(
        self, output_processor: Any, *, count_nans: bool, bulk_latencies: bool = False
    ) -> None:
        """`bulk_latencies`: leave the inter-token latencies counted by value for
        stats.BulkLatencies, not one list entry per token."""
        self._processor = output_processor
        self._bulk = bulk_latencies
        self._vllm_path = output_processor.process_outputs
        self._streams: dict[str, LeanStream] = {}
        # VLLM_COMPUTE_NANS_IN_LOGITS: every step is vLLM's (it checks each output).
        # `enabled` off (benchmarks): requests register no more, vLLM's path serves them.
        self.enabled = not count_nans
        output_processor.process_outputs = self._process_outputs

    def register(self, engine_request_id: str, stream: LeanStream) -> None:
        if self.enabled:
            self._streams[engine_request_id] = stream

    def unregister(self, engine_request_id: str) -> None:
        self._streams.pop(engine_request_id, None)

    def _process_outputs(
        self,
        engine_core_outputs: list[Any],
        engine_core_timestamp: float | None = None,
        iteration_stats: Any = None,
        weight_version: str | None = None,
    ) -> Any:
        streams = self._streams
        if not streams:
            return self._vllm_path(
                engine_core_outputs, engine_core_timestamp, iteration_stats, weight_version
            )
        states = self._processor.request_states
        rest = []
        generated = 0
        latencies = iteration_stats.inter_token_latencies_iter if iteration_stats else None
        bulk = self._bulk
        # One dict per engine step (vLLM may process a step's outputs in chunks).
        by_value = (
            vars(iteration_stats).setdefault(BULK_LATENCIES, {})
            if bulk and latencies is not None
            else {}
        )
        for out in engine_core_outputs:
            stream = streams.get(out.request_id)
            state = states.get(out.request_id) if stream is not None else None
            if stream is None or state is None or state.is_prefilling or carries_extras(out):
                rest.append(out)
                continue
            tokens = out.new_token_ids
            if weight_version is not None and tokens:
                # vLLM records where each weight version starts (a span per change).
                starts = state.weight_version_starts
                if not starts or starts[-1][0] != weight_version:
                    state.track_weight_version(weight_version)
            # What the detokenizer of a token-only request keeps (its output token ids).
            state.detokenizer.token_ids.extend(tokens)
            if latencies is not None:
                # IterationStats.update_from_output for a decode step without events.
                stats = state.stats
                stats.num_generation_tokens += len(tokens)
                generated += len(tokens)
                latency = engine_core_timestamp - stats.last_token_ts  # type: ignore[operator]
                if bulk:
                    by_value[latency] = by_value.get(latency, 0) + 1
                else:
                    latencies.append(latency)
                stats.last_token_ts = engine_core_timestamp
            stream.plain_step(tokens)
        if iteration_stats is not None:
            iteration_stats.num_generation_tokens += generated
        # vLLM's path for the rest, also when empty (it returns its own result type).
        return self._vllm_path(rest, engine_core_timestamp, iteration_stats, weight_version)
