"""Every vLLM internal this adapter touches, named once and checked when the engine starts.

The adapter speaks vLLM's public API (`AsyncLLM.generate`, `abort`, `check_health`,
`SamplingParams`, ...) and, for speed or for facts that API does not give, a few
internals. Each internal is a `TouchPoint` below: what it is, the feature that needs
it, and what a mismatch does instead. `check_touch_points(llm)` looks at each one
(attributes, the attributes a constructor assigns, `inspect.signature`), logs one line
per mismatch and returns the features that may run, which the adapter reads to turn
each feature off; the worker always keeps serving. One exception: KV_STORE's connector
runs inside vLLM's engine core, not here, so it applies the same check itself
(`kv_store_problem`, in kv_store.py) and this process's check only reports it at start.
The suite ran on the versions in `CHECKED_VERSIONS`; another version only adds a log
line, the checks decide.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .introspect import assigned_attributes, called_names, missing, parameters
from .weight_reload import abort_problem as reload_abort_problem

logger = logging.getLogger(__name__)

# vLLM releases whose touch points were read and the suite was run on (0.33 read from
# its wheel's source: the same names and signatures at every touch point below).
CHECKED_VERSIONS = ("0.32.0", "0.33.0")

LEAN_OUTPUTS = "lean outputs"
ENGINE_SERIES = "per-engine vllm:* series"
KV_EVENT_ENDPOINT = "KV event endpoint check"
LOAD_FIGURES = "load figures"
TOKENIZE = "text prompt tokenization"
RENDER = "prompt rendering"
KV_STORE = "SharedStorageConnector's strict loads"
MEDIA = "images and other media"
FAST_OUTPUTS = "token-only decode steps without vLLM's per-request output work"
BULK_LATENCIES = "inter-token latencies observed by value, not one by one"
ENGINE_PROGRESS = "the engine progress watchdog"
DIRECT_ENTRY = "token-id requests into the engine core without add_request's general work"
WEIGHT_TRANSFER = "RL weight updates (vllm.Control's weight-transfer RPCs)"
WEIGHT_RELOAD_ABORT = "undoing a weight load that failed part-way (the file backend)"
# The connector's name in a kv_transfer_config (kv_store.py).
KV_STORE_CONNECTOR = "SharedStorageConnector"

# The public path lean outputs fall back to.
GENERATE_PATH = "every request through AsyncLLM.generate"

# What RequestState.make_request_output takes; LeanStream's handler takes the same.
MAKE_REQUEST_OUTPUT_PARAMS = (
    "new_token_ids", "pooling_output", "finish_reason", "stop_reason",
    "kv_transfer_params", "ec_transfer_params", "error",
)  # fmt: skip
# What AsyncLLM.add_request / generate receive from the adapter by keyword.
REQUEST_KEYWORDS = ("lora_request", "trace_headers", "priority", "data_parallel_rank")
# Every call AsyncLLM.add_request and _add_request make, as read for entry.py (which makes
# the ones a token-only request reaches); a vLLM whose add_request calls anything else
# does something entry.py does not.
ADD_REQUEST_CALLS = {
    "add_request": (
        "EngineDeadError", "ParentRequest", "RequestOutputCollector", "VLLMValidationError",
        "child_requests.append", "copy", "enumerate", "extract_prompt_components",
        "isinstance", "log_tracing_disabled_warning", "logger.info", "logger.warning_once",
        "parent_request.get_child_info", "range", "self._add_request",
        "self._add_streaming_input_request", "self._run_output_handler", "self.abort",
        "self.check_admission", "self.engine_core.add_request_async",
        "self.get_supported_tasks", "self.input_processor.apply_watermarking",
        "self.input_processor.assign_request_id", "self.input_processor.process_inputs",
        "self.input_processor.process_inputs_async",
        "self.input_processor.resolve_watermarking", "self.output_processor.add_request",
    ),
    "_add_request": (
        "logger.info", "self.check_admission", "self.engine_core.add_request_async",
        "self.output_processor.add_request", "self.output_processor.has_request",
    ),
}  # fmt: skip
STAT_RECORD_PARAMS = ("scheduler_stats", "iteration_stats", "mm_cache_stats", "engine_idx")
SCHEDULER_STATS_FIELDS = (
    "num_running_reqs", "num_waiting_reqs", "num_skipped_waiting_reqs", "kv_cache_usage",
)  # fmt: skip


def _make_request_output(llm: Any) -> str | None:
    from vllm.v1.engine.output_processor import RequestState

    have = parameters(RequestState.make_request_output)
    if have != MAKE_REQUEST_OUTPUT_PARAMS:
        return f"takes ({', '.join(have)}), expected ({', '.join(MAKE_REQUEST_OUTPUT_PARAMS)})"
    return missing(
        assigned_attributes(RequestState),
        ("queue", "detokenizer", "stream_interval", "num_cached_tokens"),
    )


def _request_states(llm: Any) -> str | None:
    from vllm.v1.engine.output_processor import OutputProcessor

    processor = getattr(llm, "output_processor", None)
    if not isinstance(processor, OutputProcessor):
        return "AsyncLLM.output_processor is not vLLM's OutputProcessor"
    if not isinstance(getattr(processor, "request_states", None), dict):
        return "OutputProcessor.request_states is not a dict"
    return None


def _add_request(llm: Any) -> str | None:
    from vllm.v1.engine.output_processor import RequestOutputCollector

    problem = missing(parameters(type(llm).add_request), ("request_id", "prompt", "params",
                                                           *REQUEST_KEYWORDS))  # fmt: skip
    problem = problem or missing(parameters(type(llm).abort), ("request_id", "internal"))
    collector = {*dir(RequestOutputCollector), *assigned_attributes(RequestOutputCollector)}
    return problem or missing(collector, ("request_id", "get_nowait", "close"))


def _direct_entry(llm: Any) -> str | None:
    import vllm.tracing
    from vllm.v1.engine.async_llm import AsyncLLM

    if not hasattr(vllm.tracing, "log_tracing_disabled_warning"):
        return "vllm.tracing.log_tracing_disabled_warning is gone"

    for name, expected in ADD_REQUEST_CALLS.items():
        have = called_names(getattr(AsyncLLM, name))
        if have != set(expected):
            changed = sorted(have.symmetric_difference(expected))
            return f"AsyncLLM.{name} calls differ from the ones read: {', '.join(changed)}"
    problem = missing(parameters(type(llm.input_processor).process_inputs), (
        "request_id", "prompt", "params", "supported_tasks", "trace_headers", "priority",
        "data_parallel_rank", "session_id"))  # fmt: skip
    problem = problem or missing(
        parameters(type(llm.output_processor).add_request),
        ("request", "prompt", "parent_req", "request_index", "queue"),
    )
    problem = problem or missing(parameters(type(llm).check_admission), ("n", "request_id"))
    if problem is None and parameters(type(llm.renderer).get_eos_token_id):
        problem = "renderer.get_eos_token_id takes arguments"
    return problem or missing(
        {*dir(llm), *dir(llm.engine_core), *dir(llm.output_processor)},
        ("_run_output_handler", "log_requests", "observability_config", "add_request_async",
         "has_request", "get_supported_tasks"),
    )  # fmt: skip


def _detokenizer(llm: Any) -> str | None:
    from vllm.v1.engine.detokenizer import IncrementalDetokenizer

    have = parameters(IncrementalDetokenizer.get_next_output_text)
    return None if have == ("finished", "delta") else f"takes ({', '.join(have)})"


def _collector_to_names(llm: Any) -> str | None:
    from prometheus_client import REGISTRY

    found = getattr(REGISTRY, "_collector_to_names", None)
    return None if isinstance(found, dict) else "prometheus_client's REGISTRY has no such dict"


def _bind_endpoint(llm: Any) -> str | None:
    from vllm.distributed.kv_events import ZmqEventPublisher

    problem = missing(parameters(ZmqEventPublisher._is_bind_endpoint), ("endpoint",))
    return problem or missing(
        parameters(ZmqEventPublisher.offset_endpoint_port), ("endpoint", "data_parallel_rank")
    )


def _stat_logger(llm: Any) -> str | None:
    from vllm.v1.metrics.loggers import StatLoggerBase
    from vllm.v1.metrics.stats import SchedulerStats

    problem = missing(parameters(StatLoggerBase.record), STAT_RECORD_PARAMS)
    fields = set(getattr(SchedulerStats, "__dataclass_fields__", {}))
    return problem or missing(fields, SCHEDULER_STATS_FIELDS)


def _renderer_tokenize(llm: Any) -> str | None:
    renderer = getattr(llm, "renderer", None)
    if renderer is None:
        return "AsyncLLM has no renderer"
    problem = missing(parameters(type(renderer).tokenize_prompt_async), ("prompt", "params"))
    return problem or missing(set(dir(type(renderer))), ("default_cmpl_tok_params",))


def _renderer_process(llm: Any) -> str | None:
    renderer = getattr(llm, "renderer", None)
    if renderer is None:
        return "AsyncLLM has no renderer"
    return missing(parameters(type(renderer).process_for_engine), ("prompt", "arrival_time"))


def _fast_outputs(llm: Any) -> str | None:
    from vllm.v1.engine import EngineCoreOutput
    from vllm.v1.engine.detokenizer import IncrementalDetokenizer as Detokenizer
    from vllm.v1.engine.output_processor import RequestState
    from vllm.v1.metrics.stats import IterationStats, RequestStateStats

    from .fast_outputs import EXTRAS

    problem = missing(
        parameters(type(llm.output_processor).process_outputs),
        ("engine_core_outputs", "engine_core_timestamp", "iteration_stats", "weight_version"),
    )
    problem = problem or missing(
        EngineCoreOutput.__struct_fields__, ("request_id", "new_token_ids", *EXTRAS)
    )
    problem = problem or missing(
        assigned_attributes(IterationStats), ("num_generation_tokens", "inter_token_latencies_iter")
    )
    problem = problem or missing(
        set(RequestStateStats.__dataclass_fields__), ("num_generation_tokens", "last_token_ts")
    )
    problem = problem or missing(assigned_attributes(Detokenizer), ("token_ids",))
    return problem or missing(assigned_attributes(RequestState),
                               ("is_prefilling", "stats", "detokenizer",
                                "weight_version_starts")) or missing(
        set(dir(RequestState)), ("track_weight_version",))  # fmt: skip


def _bulk_latencies(llm: Any) -> str | None:
    from prometheus_client import Histogram
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    manager = getattr(llm, "logger_manager", None)
    if manager is None:
        return None  # statistics off (--disable-log-stats): nothing is observed
    prometheus = [x for x in manager.stat_loggers if isinstance(x, PrometheusStatLogger)]
    if len(prometheus) != 1:
        return f"AsyncLLM has {len(prometheus)} Prometheus stat loggers, expected 1"
    problem = missing(parameters(type(prometheus[0]).record), STAT_RECORD_PARAMS)
    histograms = getattr(prometheus[0], "histogram_inter_token_latency", None)
    if problem is None and not isinstance(histograms, dict):
        problem = "PrometheusStatLogger.histogram_inter_token_latency is not a dict"
    probe = Histogram("probe", "", registry=None)
    return problem or missing(set(vars(probe)), ("_sum", "_buckets", "_upper_bounds"))


def _media(llm: Any) -> str | None:
    from vllm.inputs import engine as inputs
    from vllm.multimodal.inputs import MultiModalFieldConfig, MultiModalKwargsItems
    from vllm.multimodal.media.image import ImageMediaIO

    if not llm.model_config.is_multimodal_model:
        return None  # a text-only model: nothing to check
    renderer = type(llm.renderer)
    problem = missing(
        parameters(renderer.process_for_engine_async), ("prompt", "arrival_time", "skip_mm_cache")
    )
    problem = problem or missing(set(dir(renderer)), ("get_mm_processor",))
    problem = problem or missing(parameters(inputs.mm_input), (
        "prompt_token_ids", "mm_kwargs", "mm_hashes", "mm_placeholders"))  # fmt: skip
    problem = problem or missing(parameters(MultiModalKwargsItems.from_hf_inputs),
                                  ("hf_inputs", "config_by_key"))  # fmt: skip
    problem = problem or missing(set(dir(MultiModalFieldConfig)),
                                  ("batched", "flat_from_sizes", "shared"))  # fmt: skip
    processor = llm.renderer.get_mm_processor()
    problem = problem or missing(set(dir(processor)), ("_get_mm_fields_config", "info"))
    return problem or missing(set(dir(ImageMediaIO)), ("load_bytes",))


def kv_store_problem() -> str | None:
    """What kv_store.SharedStorageConnector needs of vLLM's ExampleConnector, or None."""
    from vllm.distributed.kv_transfer.kv_connector.v1 import example_connector as example

    connector = example.ExampleConnector
    problem = missing(set(dir(connector)), (
        "_get_connector_metadata", "_generate_filename_debug", "_found_match_for_request",
        "get_num_new_matched_tokens", "request_finished", "start_load_kv",
        "get_block_ids_with_load_errors",
    )) or missing(assigned_attributes(connector), ("_block_size",))  # fmt: skip
    fields = set(getattr(example.ReqMeta, "__dataclass_fields__", {}))
    problem = problem or missing(fields, ("token_ids", "slot_mapping", "is_store", "mm_hashes"))
    if problem is None and not callable(getattr(example, "align_to_block_size", None)):
        problem = "example_connector.align_to_block_size is gone"
    return problem and f"vLLM's ExampleConnector {problem}"


def _kv_store(llm: Any) -> str | None:
    kv = llm.vllm_config.kv_transfer_config
    if kv is None or KV_STORE_CONNECTOR not in str(kv.kv_connector) + str(
        kv.kv_connector_extra_config
    ):
        return None  # not configured: nothing to check
    return kv_store_problem()


# AsyncLLM's weight-transfer methods and the keyword each takes (all but version calls
# reach the workers through collective_rpc).
WEIGHT_TRANSFER_METHODS = {
    "init_weight_transfer_engine": (),
    "start_weight_update": (),
    "start_draft_weight_update": (),
    "update_weights": (),
    "finish_weight_update": ("weight_version",),
}


def _weight_transfer(llm: Any) -> str | None:
    try:
        from vllm.distributed.weight_transfer.base import (
            WeightTransferInitRequest,
            WeightTransferUpdateRequest,
        )
    except ImportError as exc:
        return f"no weight-transfer request types ({exc})"
    for name, keywords in WEIGHT_TRANSFER_METHODS.items():
        method = getattr(type(llm), name, None)
        if method is None:
            return f"AsyncLLM.{name} is gone"
        problem = missing(parameters(method), keywords)
        if problem:
            return f"AsyncLLM.{name}: {problem}"
    return missing(parameters(WeightTransferInitRequest), ("init_info",)) or missing(
        parameters(WeightTransferUpdateRequest), ("update_info",)
    )


@dataclass(frozen=True)
class TouchPoint:
    name: str
    feature: str
    fallback: str
    # The problem when this vLLM does not match, None when it does (given the AsyncLLM).
    check: Callable[[Any], str | None]


def _engine_progress(llm: Any) -> str | None:
    # Work in the engine is its output processor's unfinished requests; a step is one
    # stat-logger record (vLLM sends scheduler stats with every step while it logs stats).
    return _request_states(llm) or _stat_logger(llm)


TOUCH_POINTS = (
    TouchPoint("RequestState.make_request_output and its attributes", LEAN_OUTPUTS,
               GENERATE_PATH, _make_request_output),
    TouchPoint("OutputProcessor.request_states", LEAN_OUTPUTS,
               GENERATE_PATH, _request_states),
    TouchPoint("AsyncLLM.add_request / abort(internal=) / RequestOutputCollector", LEAN_OUTPUTS,
               GENERATE_PATH, _add_request),
    TouchPoint("AsyncLLM.add_request's calls, InputProcessor.process_inputs, "
               "OutputProcessor.add_request, check_admission, renderer.get_eos_token_id",
               DIRECT_ENTRY,
               "token-id requests through AsyncLLM.add_request", _direct_entry),
    TouchPoint("IncrementalDetokenizer.get_next_output_text", LEAN_OUTPUTS,
               GENERATE_PATH, _detokenizer),
    TouchPoint("prometheus_client REGISTRY._collector_to_names", ENGINE_SERIES,
               "/metrics forwards the whole process registry", _collector_to_names),
    TouchPoint("ZmqEventPublisher._is_bind_endpoint / offset_endpoint_port", KV_EVENT_ENDPOINT,
               "our own copy of the bind rule (wildcard, ipc, inproc)", _bind_endpoint),
    TouchPoint("StatLoggerBase.record and SchedulerStats fields", LOAD_FIGURES,
               "every rank's load figures are reported unknown (GetLoads leaves their time "
               "unset or the rank out; WorkerMetrics read 0)", _stat_logger),
    TouchPoint("OutputProcessor.request_states with StatLoggerBase.record once per engine step",
               ENGINE_PROGRESS, "no progress watchdog: a stuck engine core is found only "
               "when it dies", _engine_progress),
    TouchPoint("renderer.tokenize_prompt_async / default_cmpl_tok_params", TOKENIZE,
               "the tokenizer's encode (special tokens added)", _renderer_tokenize),
    TouchPoint("renderer.process_for_engine", RENDER,
               "a token prompt handed to AsyncLLM as is", _renderer_process),
    TouchPoint("OutputProcessor.process_outputs, EngineCoreOutput and the stats it updates",
               FAST_OUTPUTS, "every step through vLLM's process_outputs (lean outputs)",
               _fast_outputs),
    TouchPoint("PrometheusStatLogger.record / histogram_inter_token_latency, prometheus_client "
               "Histogram._sum / _buckets / _upper_bounds", BULK_LATENCIES,
               "one observation per token, as vLLM's path", _bulk_latencies),
    TouchPoint("renderer multimodal processing, mm_input, MultiModalKwargsItems, ImageMediaIO",
               MEDIA, "media requests are refused (the model is served as text-only)", _media),
    TouchPoint("AsyncLLM weight-transfer methods, WeightTransferInitRequest / "
               "WeightTransferUpdateRequest", WEIGHT_TRANSFER,
               "the weight-transfer RPCs answer UNIMPLEMENTED", _weight_transfer),
    TouchPoint("layerwise reload's LAYERWISE_INFO / LOADING_LAYERS / _place_kernel_tensors, "
               "LayerReloadingInfo.kernel_tensors / can_load / reset", WEIGHT_RELOAD_ABORT,
               "a file-backend Finish whose load fails cannot be undone: the worker exits for "
               "a restart instead of serving a part-loaded model",
               lambda llm: reload_abort_problem()),
    # Reported here; the connector, in the engine core, turns itself off (kv_store.py).
    TouchPoint("ExampleConnector internals (configured connectors only)", KV_STORE,
               "the connector runs as vLLM's ExampleConnector: a decode request whose KV "
               "is not in the store recomputes its prompt, and a KV file that is gone or "
               "mis-shaped at load time raises in the engine core's forward pass, which "
               "kills the engine", _kv_store),
)  # fmt: skip


def _version_checked(version: str) -> bool:
    base = version.split("+", 1)[0]
    return base in CHECKED_VERSIONS


def check_touch_points(
    llm: Any, touch_points: tuple[TouchPoint, ...] = TOUCH_POINTS
) -> frozenset[str]:
    """The features whose touch points all match this vLLM (one log line per mismatch)."""
    import vllm

    if not _version_checked(vllm.__version__):
        logger.warning(
            "vLLM %s is not among the versions this worker was checked on (%s); "
            "its touch points are checked one by one",
            vllm.__version__,
            ", ".join(CHECKED_VERSIONS),
        )
    features = {point.feature for point in touch_points}
    for point in touch_points:
        try:
            problem = point.check(llm)
        except Exception as exc:  # an import path or attribute that moved
            problem = f"{type(exc).__name__}: {exc}"
        if problem is not None:
            features.discard(point.feature)
            logger.warning(
                "vLLM touch point %s does not match (%s): %s off, %s",
                point.name, problem, point.feature, point.fallback,
            )  # fmt: skip
    return frozenset(features)
