"""One generation on vLLM's AsyncLLM -> EngineSteps, on one of two output paths.

`request_output_steps` reads vLLM's RequestOutputs (`AsyncLLM.generate`): every
request can take it. `lean_steps` reads a `LeanStream` (lean.py) for requests that
need neither logprobs nor several samples: the same tokens, text and finish, without a
RequestOutput per step. Both end with the request gone from the engine: finished,
aborted when the consumer leaves early, or failed with the engine.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any

from ..direct import DirectReceiver
from ..types import EngineStep, SamplingOptions
from .entry import DirectEntry, VllmCall
from .fast_outputs import FastOutputs
from .lean import LeanStream
from .params import (
    convert_logprobs,
    convert_prompt_logprobs,
    finish_of,
    reraise,
    spec_decode_of,
)

if TYPE_CHECKING:
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.engine.async_llm import AsyncLLM


async def lean_steps(
    llm: AsyncLLM,
    call: VllmCall,
    fast: FastOutputs | None = None,
    receiver: DirectReceiver | None = None,
    entry: DirectEntry | None = None,
) -> AsyncGenerator[EngineStep, None]:
    """A lean request's steps; with `fast`, a token-only one's decode steps skip vLLM's
    per-request output work (fast_outputs.py), and with `receiver` (given with `fast`, for
    a request direct.takes_direct_steps allows) they go direct to it by the rule of
    direct.py. With `entry`, the request reaches the engine core through it (entry.py),
    else through add_request."""
    request: EngineCoreRequest | None = None
    queue: Any = None
    try:
        if entry is not None:
            request = entry.register(call, await entry.supported_tasks())
            request_id = request.request_id
        else:
            queue = await llm.add_request(call.request_id, call.prompt, call.params, **call.options)
            request_id = queue.request_id
    except Exception as exc:
        reraise(exc)
    stream: LeanStream | None = None
    try:
        # Inside the try: a takeover that fails still aborts the request below.
        state = llm.output_processor.request_states.get(request_id)
        stream = LeanStream(
            call.request_id,
            state,
            detokenize=call.detokenize,
            prompt_tokens=len(call.prompt_token_ids),
            receiver=receiver,
        )
        if request is not None and entry is not None:
            try:
                await entry.send(request)
            except Exception as exc:
                reraise(exc)
        else:
            # Not seen in practice (the engine core cannot answer before add_request
            # returns), but an output vLLM queued before the takeover is not lost.
            try:
                early = queue.get_nowait()
            except Exception as exc:
                reraise(exc)
            if early is not None:
                stream.absorb(early)
            elif state is None:
                raise RuntimeError(
                    f"vLLM dropped request {call.request_id} before its first output"
                )
        if fast is not None and not call.detokenize:
            fast.register(request_id, stream)
        finished = False
        while not finished:
            try:
                step = await stream.next_step()
            except Exception as exc:
                reraise(exc)
            finished = step.finished
            yield step
    finally:
        if fast is not None:
            fast.unregister(request_id)
        # A consumer that left early (client gone, cancelled, a failure here) ends the
        # request in the engine, as AsyncLLM.generate does.
        if (stream is None or not stream.finished) and not llm.errored:
            await llm.abort(request_id, internal=True)
        if queue is not None:
            queue.close()


async def request_output_steps(
    llm: AsyncLLM, call: VllmCall, options: SamplingOptions
) -> AsyncGenerator[EngineStep, None]:
    num_top = options.logprobs or 0  # -1: the whole vocabulary
    by_id = options.logprob_token_ids
    want_logprobs = options.logprobs is not None or bool(by_id)
    samples = call.params.n
    produced = [0] * samples
    last_token: list[int | None] = [None] * samples
    prompt_top = options.prompt_logprobs
    outputs = llm.generate(call.prompt, call.params, call.request_id, **call.options)
    try:
        while True:
            # Only vLLM's own call is translated: a failure in the conversion
            # below is a bug of ours and must surface as one (INTERNAL).
            try:
                out = await outputs.__anext__()
            except StopAsyncIteration:
                return
            except Exception as exc:
                reraise(exc)
            for completion in out.outputs:
                index = completion.index
                token_ids = list(completion.token_ids)
                produced[index] += len(token_ids)
                if token_ids:
                    last_token[index] = token_ids[-1]
                finish, stop_reason, error = finish_of(
                    completion.finish_reason, completion.stop_reason, last_token[index]
                )
                step = EngineStep(
                    token_ids=token_ids,
                    text=completion.text,
                    finished=finish is not None,
                    finish_reason=finish,
                    stop_reason=stop_reason,
                    error=error,
                    prompt_tokens=len(out.prompt_token_ids or ()),
                    completion_tokens=produced[index],
                    cached_tokens=out.num_cached_tokens or 0,
                    logprobs=convert_logprobs(token_ids, completion.logprobs, num_top, by_id)
                    if want_logprobs
                    else None,
                    index=index,
                )
                if step.finished:
                    if out.kv_transfer_params:
                        step.kv_transfer_params = out.kv_transfer_params
                    step.spec_decode = spec_decode_of(completion.spec_decode_metrics)
                if prompt_top is not None and index == 0 and out.prompt_logprobs:
                    step.prompt_logprobs = convert_prompt_logprobs(
                        call.prompt_token_ids, out.prompt_logprobs, prompt_top
                    )
                    prompt_top = None
                yield step
    finally:
        # Closing vLLM's generator early aborts the request inside the engine.
        await outputs.aclose()
