"""vLLM's public API this worker calls, named once: what `vllm-servicer check-vllm` lists
beside the touch points (compat.py).

Unlike a touch point, a public call has no fallback: an essential one that is gone leaves no
worker (check-vllm exits 1), another stops the RPCs that need it. Each entry names what the
worker passes or reads (parameters, fields, attributes) and how vLLM's offer is read, from its
classes and signatures, without an engine.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from ..types import StructuredOutputs
from .compat import REQUEST_KEYWORDS
from .introspect import attribute_names, missing, parameters, raised
from .params import SAMPLING_KEYWORDS

# What AsyncLLM.generate receives only for a request that sets them (adapter.py leaves them
# out otherwise, so a vLLM without them serves every other request).
OPTIONAL_REQUEST_KEYWORDS = ("session_id", "reasoning_ended", "reasoning_parser_kwargs")


@dataclass(frozen=True)
class PublicCall:
    """A piece of vLLM's public API the worker calls, with no fallback: the names it passes
    or reads (parameters, fields, attributes). An essential one gone leaves no worker."""

    name: str
    # The names the worker uses, all of which vLLM must offer.
    uses: tuple[str, ...]
    # The names vLLM offers (parameters, fields or attributes); raises where it is gone.
    offers: Callable[[], set[str]]
    # What needs it: for an essential call, what the worker does with it; for another,
    # what stops working without it (the rest of the worker serves on).
    needed_by: str
    essential: bool = True
    # Names passed only for a request that sets them (a vLLM without them serves the rest).
    optional: tuple[str, ...] = ()


def _vllm_object(path: str) -> Any:
    """`vllm.a.b:C.d` -> that object (module path, then attributes); raises where gone."""
    module, _, attributes = path.partition(":")
    found: Any = importlib.import_module(module)
    for name in attributes.split(".") if attributes else ():
        found = getattr(found, name)
    return found


def _parameters_of(path: str) -> Callable[[], set[str]]:
    return lambda: set(parameters(_vllm_object(path)))


def _attributes_of(path: str) -> Callable[[], set[str]]:
    return lambda: attribute_names(_vllm_object(path))


def _module_names(*modules: str) -> Callable[[], set[str]]:
    return lambda: {name for module in modules for name in dir(importlib.import_module(module))}


ASYNC_LLM = "vllm.v1.engine.async_llm:AsyncLLM"
# What build_sampling_params sets on or reads from a SamplingParams after building it.
SAMPLING_ATTRIBUTES = ("n", "seed", "skip_reading_prefix_cache")

PUBLIC_API = (
    PublicCall("AsyncEngineArgs", (
        "add_cli_args", "from_cli_args", "create_engine_config", "disable_log_stats",
        "enable_log_requests"), _attributes_of("vllm.engine.arg_utils:AsyncEngineArgs"),
        "the command line (vLLM's engine flags) and the engine's configuration"),
    PublicCall("vllm.utils.argparse_utils", ("FlexibleArgumentParser",),
        _module_names("vllm.utils.argparse_utils"), "the command line's parser"),
    PublicCall("UsageContext", ("OPENAI_API_SERVER",),
        _attributes_of("vllm.usage.usage_lib:UsageContext"), "the engine's start"),
    PublicCall("AsyncLLM.from_vllm_config", (
        "vllm_config", "usage_context", "stat_loggers", "enable_log_requests",
        "disable_log_stats"), _parameters_of(f"{ASYNC_LLM}.from_vllm_config"),
        "the engine's start (with the worker's stat logger)"),
    PublicCall("AsyncLLM.generate", (
        "prompt", "sampling_params", "request_id", *REQUEST_KEYWORDS),
        _parameters_of(f"{ASYNC_LLM}.generate"),
        "every request (the public path)", optional=OPTIONAL_REQUEST_KEYWORDS),
    PublicCall("AsyncLLM", (
        "abort", "check_health", "errored", "shutdown", "get_tokenizer", "reset_prefix_cache",
        "vllm_config", "model_config"), _attributes_of(ASYNC_LLM),
        "abort, health, shutdown, model facts, ResetPrefixCache"),
    PublicCall("SamplingParams.from_optional", SAMPLING_KEYWORDS,
        _parameters_of("vllm.sampling_params:SamplingParams.from_optional"),
        "every request's sampling (the contracts' sampling fields, by name)"),
    PublicCall("SamplingParams", SAMPLING_ATTRIBUTES,
        _attributes_of("vllm.sampling_params:SamplingParams"),
        "shared sampling params (seed), prefix-cache skips"),
    PublicCall("RequestOutputKind", ("DELTA",),
        _attributes_of("vllm.sampling_params:RequestOutputKind"),
        "streamed outputs (only the new tokens each step)"),
    PublicCall("RequestOutput", (
        "outputs", "prompt_token_ids", "num_cached_tokens", "kv_transfer_params",
        "prompt_logprobs", "finished"), _attributes_of("vllm.outputs:RequestOutput"),
        "every answer on the public path"),
    PublicCall("CompletionOutput", (
        "index", "token_ids", "text", "finish_reason", "stop_reason", "logprobs"),
        _attributes_of("vllm.outputs:CompletionOutput"),
        "every answer on the public path"),
    PublicCall("vLLM's exceptions", (
        "GenerationError", "GracefulHTTPError", "VLLMClientError", "EngineDeadError",
        "EngineGenerateError"), _module_names("vllm.exceptions", "vllm.v1.engine.exceptions"),
        "telling the engine's errors apart (invalid request, overload, dead engine)"),
    PublicCall("StructuredOutputsParams", tuple(f.name for f in fields(StructuredOutputs)),
        _attributes_of("vllm.sampling_params:StructuredOutputsParams"),
        "requests with an output constraint (JSON schema, regex, grammar, choice) fail",
        essential=False),
    PublicCall("AsyncLLM pause and sleep", (
        "pause_generation", "resume_generation", "is_paused", "sleep", "wake_up",
        "is_sleeping"), _attributes_of(ASYNC_LLM),
        "Pause, Resume, Sleep and WakeUp fail", essential=False),
    PublicCall("AsyncLLM.pause_generation", ("mode", "clear_cache"),
        _parameters_of(f"{ASYNC_LLM}.pause_generation"), "Pause fails", essential=False),
    PublicCall("AsyncLLM.sleep's reset_connector (vLLM 0.34)", ("reset_connector",),
        _parameters_of(f"{ASYNC_LLM}.sleep"), "Sleep with reset_connector=false is refused "
        "on an engine with a KV connector (this vLLM always clears the connector's cache)",
        essential=False),
    PublicCall("CompletionOutput.spec_decode_metrics, RequestSpecDecodeMetrics", (
        "spec_decode_metrics", "num_draft_tokens", "histogram"),
        lambda: attribute_names(_vllm_object("vllm.outputs:CompletionOutput"))
        | attribute_names(_vllm_object("vllm.v1.metrics.stats:RequestSpecDecodeMetrics")),
        "speculative-decoding counts read 0 (GenerateComplete.spec_*, Usage.spec_*)",
        essential=False),
    PublicCall("AsyncLLM LoRA, LoRARequest", (
        "add_lora", "remove_lora", "lora_name", "lora_int_id", "lora_path"),
        lambda: attribute_names(_vllm_object(ASYNC_LLM))
        | attribute_names(_vllm_object("vllm.lora.request:LoRARequest")),
        "LoRA adapters (--lora-modules, LoadLoRA) fail", essential=False),
    PublicCall("AsyncLLM weight version", ("get_weight_version", "update_weight_version"),
        _attributes_of(ASYNC_LLM), "the weight version RPCs fail", essential=False),
    PublicCall("AsyncLLM profiler", ("start_profile", "stop_profile"),
        _attributes_of(ASYNC_LLM), "StartProfile and StopProfile fail", essential=False),
    PublicCall("AsyncLLM.encode, PoolingParams", (
        "prompt", "pooling_params", "request_id", "task"),
        lambda: set(parameters(_vllm_object(f"{ASYNC_LLM}.encode")))
        | attribute_names(_vllm_object("vllm.pooling_params:PoolingParams")),
        "embeddings fail", essential=False),
)  # fmt: skip


@dataclass(frozen=True)
class PublicCallResult:
    call: PublicCall
    # Why the worker cannot make this call on this vLLM, or None.
    problem: str | None
    # Optional names this vLLM lacks (the requests that set them fail).
    absent_optional: tuple[str, ...] = ()


def public_call_result(call: PublicCall) -> PublicCallResult:
    try:
        offered = call.offers()
    except Exception as exc:  # a module or an attribute that is gone
        return PublicCallResult(call, raised(exc))
    absent = tuple(name for name in call.optional if name not in offered)
    return PublicCallResult(call, missing(offered, call.uses), absent)
