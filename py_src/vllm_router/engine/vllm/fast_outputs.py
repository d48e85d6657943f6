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

import ast
import inspect
import logging
import textwrap
from collections.abc import Callable
from typing import Any

from .lean import LeanStream
from .stats import BULK_LATENCIES

logger = logging.getLogger(__name__)


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
            # Anything but new tokens sends the step to vLLM's path: the one list of those
            # fields (EXTRAS below is read from it; compat.py checks it at start). Spelled out
            # here, not called, since it runs per request per step.
            if (
                stream is None
                or state is None
                or state.is_prefilling
                or out.finish_reason is not None
                or out.stop_reason is not None
                or out.events is not None
                or out.prefill_stats is not None
                or out.kv_transfer_params is not None
                or out.ec_transfer_params is not None
                or out.new_logprobs is not None
                or out.new_prompt_logprobs_tensors is not None
                or out.prompt_token_id_logprobs is not None
                or out.pooling_output is not None
                or out.routed_experts is not None
                or out.mm_cache_miss_hashes is not None
                or out.new_sampling_mask is not None
                or out.spec_decode_metrics is not None
            ):
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


def _fields_tested(method: Callable[..., Any]) -> tuple[str, ...]:
    """The EngineCoreOutput fields `method` tests in its `or` chain (`out.X is not None`),
    read from its code once: the chain is the one list, this is its name for compat.py."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(method)))
    return tuple(
        node.left.attr
        for chain in ast.walk(tree)
        if isinstance(chain, ast.BoolOp) and isinstance(chain.op, ast.Or)
        for node in chain.values
        if isinstance(node, ast.Compare)
        and isinstance(node.left, ast.Attribute)
        and isinstance(node.left.value, ast.Name)
        and node.left.value.id == "out"
    )


# EngineCoreOutput fields that are None on a plain step (see `_process_outputs`).
EXTRAS = _fields_tested(FastOutputs._process_outputs)
