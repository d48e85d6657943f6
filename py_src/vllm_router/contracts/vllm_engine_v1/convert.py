"""vllm.engine.v1 requests -> the neutral engine types, with request validation.

Pure functions: no I/O, no server, no vLLM import, so each rule is testable on its
own. Sampling fields are read by the core's table from the one declaration
(`engine.SamplingOptions`); value ranges are the engine's to judge (vLLM's own
messages reach the client). Prompt checks that need the model's facts run at
admission (`core.prompts`), after a text prompt has been tokenized.
Responses are built in `responses.py`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...core.media_admission import checked_tensor
from ...core.request_fields import checked_dp_rank, checked_request_id
from ...core.sampling import SamplingTable
from ...engine import (
    GenerationRequest,
    MediaItem,
    ModelFacts,
    ProcessedMedia,
    SamplingOptions,
    StructuredOutputs,
)
from ...errors import InvalidRequest, Unsupported
from ...proto import vllm_engine_pb2 as pb

MAX_STOP_STRINGS = 128
MAX_STOP_STRING_CHARS = 1024


def _structured_outputs(params: pb.SamplingParams) -> StructuredOutputs | None:
    if not params.HasField("structured_outputs"):
        return None
    so = params.structured_outputs
    kind = so.WhichOneof("constraint")
    if kind is None:
        raise InvalidRequest(
            "sampling_params.structured_outputs sets no constraint: set one of json, regex, "
            "grammar, choice, json_object, structural_tag"
        )
    value: Any = getattr(so, kind)
    if kind == "choice":
        value = tuple(value.choices)
        if not value:
            raise InvalidRequest("sampling_params.structured_outputs.choice has no choices")
    return StructuredOutputs(
        **{kind: value},
        disable_any_whitespace=so.disable_any_whitespace,
        disable_additional_properties=so.disable_additional_properties,
        whitespace_pattern=so.whitespace_pattern or None,
    )


# Every field of this contract is optional: unset is None, the engine's default applies.
SAMPLING = SamplingTable(
    pb.SamplingParams.DESCRIPTOR, special={"structured_outputs": _structured_outputs}
)
_EXECUTION_MODES = {v.number: v.name for v in pb.ExecutionMode.DESCRIPTOR.values}


def to_generation_request(
    request: pb.GenerateRequest,
    facts: ModelFacts,
    trace: Mapping[str, str] | None = None,
) -> GenerationRequest:
    """Validate the fields of a GenerateRequest and turn it into an engine request."""
    request_id = checked_request_id(request.request_id)
    mode = request.execution_mode
    if mode != pb.EXECUTION_MODE_NORMAL:
        if mode not in _EXECUTION_MODES:
            raise InvalidRequest(f"execution_mode {mode} is not a known ExecutionMode value")
        raise Unsupported(
            f"execution_mode {_EXECUTION_MODES[mode]} is not implemented; "
            "only EXECUTION_MODE_NORMAL is served"
        )
    dp_rank = checked_dp_rank(
        request.dp_rank if request.HasField("dp_rank") else None, facts, "dp_rank"
    )
    if request.priority and not facts.supports_priority:
        raise InvalidRequest(
            f"priority {request.priority} needs an engine started with "
            "--scheduling-policy priority; this one schedules first come, first served"
        )
    if request.prompt_token_ids:
        prompt_ids, prompt_text = list(request.prompt_token_ids), None
    elif request.prompt_text:
        prompt_ids, prompt_text = None, request.prompt_text
    else:
        raise InvalidRequest("the prompt is empty: set prompt_token_ids (or prompt_text)")
    return GenerationRequest(
        request_id=request_id,
        prompt_token_ids=prompt_ids,
        prompt_text=prompt_text,
        sampling=to_sampling_options(request.sampling_params),
        dp_rank=dp_rank,
        detokenize=not request.skip_detokenize,
        lora_name=request.lora_name or None,
        priority=request.priority,
        trace_headers=trace,
        **_media(request.multimodal_data),
    )


def _media(items: Any) -> dict[str, Any]:
    """multimodal_data -> the request's media (encoded or URL items) or processed media."""
    media: list[MediaItem] = []
    processed: list[ProcessedMedia] = []
    for i, item in enumerate(items):
        where = f"multimodal_data[{i}]"
        if not item.modality:
            raise InvalidRequest(f'{where}.modality is empty; name it (e.g. "image")')
        forms = [name for name in ("data", "url") if getattr(item, name)]
        forms += ["processed"] if item.HasField("processed") else []
        if len(forms) != 1:
            raise InvalidRequest(
                f"{where} sets {' and '.join(forms) or 'none'} of data, url, processed; "
                "set exactly one"
            )
        if item.HasField("processed"):
            processed.append(_processed(item, where))
        else:
            media.append(
                MediaItem(item.modality, data=item.data or None, url=item.url or None,
                          uuid=item.uuid or None)
            )  # fmt: skip
    if media and processed:
        raise InvalidRequest(
            "multimodal_data mixes processed items with encoded ones; send all in one form"
        )
    return {"media": tuple(media), "processed_media": tuple(processed)}


def _processed(item: pb.MultimodalItem, where: str) -> ProcessedMedia:
    p = item.processed
    if not p.tensors:
        raise InvalidRequest(f"{where}.processed has no tensors")
    if not p.hash:
        raise InvalidRequest(f"{where}.processed.hash is empty; every item needs a content hash")
    tensors = {
        name: checked_tensor(t.dtype, list(t.shape), t.data, f"{where}.processed.tensors[{name}]")
        for name, t in p.tensors.items()
    }
    return ProcessedMedia(
        modality=item.modality,
        tensors=tensors,
        placeholders=((p.offset, p.length),),
        hashes=(p.hash,),
        embed_token_id=p.embed_token_id if p.HasField("embed_token_id") else None,
    )


def to_sampling_options(params: pb.SamplingParams) -> SamplingOptions:
    _check_stop_strings(params.stop)
    return SAMPLING.read(params)


def _check_stop_strings(stops: list[str]) -> None:
    if len(stops) > MAX_STOP_STRINGS:
        raise InvalidRequest(
            f"sampling_params.stop has {len(stops)} strings; at most {MAX_STOP_STRINGS}"
        )
    for i, stop in enumerate(stops):
        if not stop:
            raise InvalidRequest(
                f"sampling_params.stop[{i}] is empty; stop strings must be non-empty"
            )
        if len(stop) > MAX_STOP_STRING_CHARS:
            raise InvalidRequest(
                f"sampling_params.stop[{i}] has {len(stop)} characters; at most "
                f"{MAX_STOP_STRING_CHARS}"
            )
