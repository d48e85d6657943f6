"""How a request enters vLLM: `VllmCall` (what the adapter hands AsyncLLM for one request)
and, for a token-id request, `DirectEntry`: into vLLM's engine core without
`AsyncLLM.add_request`'s general work.

For a request whose prompt is token ids (no media, no LoRA) and that asks for one
sample, `AsyncLLM.add_request` does, in order: refuse on a dead engine, drop trace
headers when tracing is off, `InputProcessor.process_inputs` (validation, the request's
own SamplingParams, the EngineCoreRequest), `assign_request_id`, start the output
handler, build a `RequestOutputCollector`, `check_admission`, register the request with
the `OutputProcessor` and send it to the engine core. The lean path (lean.py) then takes
the request's state over and never uses the collector.

`DirectEntry` makes the same calls on the same objects, minus the collector, the
prompt-kind dispatch and the general path's extra awaits: vLLM's validation, id
assignment, admission limits, registration and send all stay vLLM's own. It is the same
request in the engine core, by construction: compat.py checks at start that
`add_request` and `_add_request` call exactly the functions read for this module
(`ADD_REQUEST_CALLS`), so a vLLM whose `add_request` does anything more sends every
request through `add_request` again (`lean_steps`' other path).

Measured (benchmarks/stage_budget.py): the entry costs about a third less CPU than
`add_request` for the same request.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.engine.async_llm import AsyncLLM

# vLLM's own logger for the line add_request logs per request (--enable-log-requests).
logger = logging.getLogger("vllm.v1.engine.async_llm")


@dataclass(frozen=True, slots=True)
class VllmCall:
    """Everything AsyncLLM needs for one request, built by the adapter."""

    request_id: str
    prompt: Any  # vLLM's engine input, rendered from the prompt token ids
    prompt_token_ids: list[int]
    params: SamplingParams
    # The keywords AsyncLLM.add_request and AsyncLLM.generate both take: lora_request,
    # trace_headers, priority, data_parallel_rank (and session_id, reasoning_ended,
    # reasoning_parser_kwargs where set).
    options: Mapping[str, Any]
    detokenize: bool


def read_eos_once(llm: AsyncLLM) -> None:
    """vLLM's `process_inputs` asks the renderer for the EOS id on every request, which
    asks the tokenizer through a pool of tokenizer copies and transformers' attribute
    lookup (a fifth of its time); the id is the tokenizer's constant, read here once."""
    renderer = llm.renderer
    if renderer.tokenizer is None:
        return  # vLLM warns on every call then: left as it is
    eos = renderer.get_eos_token_id()
    renderer.get_eos_token_id = lambda: eos  # type: ignore[method-assign]


class DirectEntry:
    """Token-only requests into one AsyncLLM's engine core (see the module docstring)."""

    __slots__ = ("_llm", "_tasks", "_tracing", "_tracing_off")

    def __init__(self, llm: AsyncLLM) -> None:
        self._llm = llm
        read_eos_once(llm)
        from vllm.tracing import log_tracing_disabled_warning

        self._tracing = llm.observability_config.otlp_traces_endpoint is not None
        self._tracing_off = log_tracing_disabled_warning
        # AsyncLLM.get_supported_tasks' cached answer, read on the first request (it may
        # ask the engine core).
        self._tasks: tuple[Any, ...] | None = None

    @staticmethod
    def admits(call: VllmCall) -> bool:
        """Requests whose entry is provably add_request's: a rendered token prompt (no
        media, no embeddings), one sample, no LoRA, no prompt logprobs, no reasoning gate."""
        prompt = call.prompt
        options = call.options
        return (
            isinstance(prompt, dict)
            and prompt.get("type") == "token"
            and "prompt" not in prompt
            and call.params.n == 1
            and call.params.prompt_logprobs is None
            and options.get("lora_request") is None
            and "reasoning_ended" not in options
            and "reasoning_parser_kwargs" not in options
        )

    async def supported_tasks(self) -> tuple[Any, ...]:
        if self._tasks is None:
            self._tasks = await self._llm.get_supported_tasks()
        return self._tasks

    def register(self, call: VllmCall, tasks: tuple[Any, ...]) -> EngineCoreRequest:
        """Validated, given its internal id, admitted and registered with the output
        processor (whose state the caller takes over before `send`); raises vLLM's own
        errors, as add_request would."""
        llm = self._llm
        if llm.errored:
            from vllm.v1.engine.exceptions import EngineDeadError

            raise EngineDeadError()
        options = call.options
        trace_headers = options.get("trace_headers")
        if trace_headers and not self._tracing:
            self._tracing_off()  # as add_request: vLLM says it once, and they are dropped
            trace_headers = None
        processor = llm.input_processor
        request = processor.process_inputs(
            call.request_id,
            call.prompt,
            call.params,
            supported_tasks=tasks,
            trace_headers=trace_headers,
            priority=options.get("priority", 0),
            data_parallel_rank=options.get("data_parallel_rank"),
            session_id=options.get("session_id"),
        )
        processor.assign_request_id(request)
        llm._run_output_handler()
        outputs = llm.output_processor
        if not outputs.has_request(request.request_id):
            llm.check_admission(request_id=request.request_id)
        outputs.add_request(request, None, None, 0, None)
        return request

    async def send(self, request: EngineCoreRequest) -> None:
        await self._llm.engine_core.add_request_async(request)
        if self._llm.log_requests:
            logger.info("Added request %s.", request.request_id)
