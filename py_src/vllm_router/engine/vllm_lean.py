"""Lean outputs: a request's new tokens handed from vLLM's OutputProcessor without RequestOutputs.

For every request and every engine step, vLLM's `AsyncLLM.generate` path builds a
`CompletionOutput` and a `RequestOutput`, slices logprobs, puts the result in an
`asyncio.Event`-guarded collector and resumes one more async-generator layer. A request
that asks for one sample and no logprobs needs none of that: only the new token ids,
the text delta, the finish and the cached-token count.

`LeanStream` takes over one request's hand-off point inside vLLM's own OutputProcessor:
the request state's `make_request_output` (called once per step, and by aborts) and its
queue (which receives engine-death errors). Everything else the OutputProcessor does per
step runs unchanged: detokenization and stop strings, `vllm:*` statistics, tracing, the
abort of a request a stop string ended, admission counts. `LeanStream` buffers what is
new and wakes its consumer once; a consumer that falls behind gets one merged batch, as
vLLM's collector merges deltas.
"""

from __future__ import annotations

import asyncio
from typing import Any

from .types import EngineStep, SamplingOptions


def lean_eligible(options: SamplingOptions, samples: int) -> bool:
    """Requests whose outputs carry nothing a RequestOutput adds over a LeanStream."""
    return samples == 1 and options.logprobs is None and options.prompt_logprobs is None


def lean_supported(llm: Any) -> bool:
    """Whether this vLLM has the hand-off points a LeanStream takes over (checked at start)."""
    from vllm.v1.engine.output_processor import OutputProcessor, RequestState

    processor = getattr(llm, "output_processor", None)
    return (
        isinstance(processor, OutputProcessor)
        and isinstance(getattr(processor, "request_states", None), dict)
        and callable(getattr(RequestState, "make_request_output", None))
    )


def reported_stop_reason(
    finish_reason: str | None, stop_reason: int | str | None, last_token: int | None
) -> int | str | None:
    """What a step reports as the match: a request that ended on EOS reports that EOS id."""
    if finish_reason == "stop" and stop_reason is None:
        return last_token
    return stop_reason


class LeanStream:
    """One request's outputs, taken from its vLLM RequestState (see the module docstring)."""

    __slots__ = (
        "_detokenizer",
        "_error",
        "_finish",
        "_interval",
        "_kv_transfer_params",
        "_last_token",
        "_produced",
        "_prompt_tokens",
        "_started",
        "_state",
        "_stop_reason",
        "_text",
        "_token_ids",
        "_waiter",
    )

    def __init__(self, state: Any | None, *, detokenize: bool, prompt_tokens: int) -> None:
        """Takes over `state`; None: vLLM already dropped it (see `absorb`)."""
        self._state = state
        self._prompt_tokens = prompt_tokens
        self._produced = 0
        self._last_token: int | None = None
        # vLLM's rule, per request: the first tokens at once, then every `interval`
        # tokens, the finish at once (RequestState.stream_interval folds in the
        # engine-wide --stream-interval).
        self._interval: int = max(1, state.stream_interval) if state is not None else 1
        self._detokenizer = state.detokenizer if detokenize and state is not None else None
        self._token_ids: list[int] = []
        self._text: list[str] = []
        self._finish: str | None = None
        self._stop_reason: int | str | None = None
        self._kv_transfer_params: dict[str, Any] | None = None
        self._error: BaseException | None = None
        self._started = False
        self._waiter: asyncio.Future[None] | None = None
        if state is not None:
            state.make_request_output = self._on_output
            state.queue = self

    @property
    def finished(self) -> bool:
        return self._finish is not None

    def _on_output(
        self,
        new_token_ids: list[int],
        pooling_output: Any,
        finish_reason: Any,
        stop_reason: int | str | None,
        kv_transfer_params: dict[str, Any] | None = None,
        ec_transfer_params: dict[str, Any] | None = None,
        error: Any = None,
    ) -> None:
        # Returning None tells the OutputProcessor there is nothing to queue.
        self._token_ids += new_token_ids
        finished = finish_reason is not None
        if self._detokenizer is not None:
            text = self._detokenizer.get_next_output_text(finished, True)
            if text:
                self._text.append(text)
        if finished:
            self._finish = str(finish_reason)
            self._stop_reason = stop_reason
            self._kv_transfer_params = kv_transfer_params
        if self._ready():
            self._wake()

    def absorb(self, output: Any) -> None:
        """A RequestOutput vLLM queued before this stream took over (merged into the next batch)."""
        completion = output.outputs[0]
        self._token_ids += completion.token_ids
        if completion.text:
            self._text.append(completion.text)
        if completion.finish_reason is not None:
            self._finish = completion.finish_reason
            self._stop_reason = completion.stop_reason
            self._kv_transfer_params = output.kv_transfer_params

    def put(self, output: Any) -> None:
        """The OutputProcessor's queue interface: only errors arrive here (engine death)."""
        if isinstance(output, BaseException):
            self._error = output
            self._wake()

    def _ready(self) -> bool:
        if self._finish is not None or self._error is not None:
            return True
        pending = len(self._token_ids)
        return pending > 0 and (not self._started or pending >= self._interval)

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    async def next_step(self) -> EngineStep:
        """Waits until something is due, then takes everything buffered as one step."""
        while not self._ready():
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        if self._error is not None:
            raise self._error
        token_ids = self._token_ids
        self._token_ids = []
        self._produced += len(token_ids)
        if token_ids:
            self._last_token = token_ids[-1]
        finish = self._finish
        step = EngineStep(
            token_ids=token_ids,
            text="".join(self._text) if self._text else "",
            finished=finish is not None,
            finish_reason=finish,  # type: ignore[arg-type]
            stop_reason=reported_stop_reason(finish, self._stop_reason, self._last_token),
            prompt_tokens=self._prompt_tokens,
            completion_tokens=self._produced,
            cached_tokens=self._state.num_cached_tokens if self._state is not None else 0,
            kv_transfer_params=self._kv_transfer_params,
        )
        self._text.clear()
        self._started = True
        return step
