"""Lean outputs: a request's new tokens handed from vLLM's OutputProcessor without RequestOutputs.

For every request and every engine step, vLLM's `AsyncLLM.generate` path builds a
`CompletionOutput` and a `RequestOutput`, slices logprobs, puts the result in an
`asyncio.Event`-guarded collector and resumes one more async-generator layer. A request
that asks for one sample and no logprobs needs none of that: only the new token ids,
the text delta, the finish and the cached-token count.

`LeanStream` takes over one request's output point inside vLLM's own OutputProcessor:
the request state's `make_request_output` (called once per step, and by aborts) and its
queue (which receives engine-death errors). Everything else the OutputProcessor does per
step runs unchanged: detokenization and stop strings, `vllm:*` statistics, tracing, the
abort of a request a stop string ended, admission counts. `LeanStream` buffers what is
new and wakes its consumer once; a consumer that falls behind gets one merged batch, as
vLLM's collector merges deltas.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from ..direct import DirectReceiver, DirectSteps
from ..types import EngineStep
from .params import finish_of, spec_decode_of

logger = logging.getLogger(__name__)


class LeanStream:
    """One request's outputs, taken from its vLLM RequestState (see the module docstring)."""

    __slots__ = (
        "_detokenizer",
        "_direct",
        "_error",
        "_error_detail",
        "_failed",
        "_finish",
        "_interval",
        "_kv_transfer_params",
        "_prompt_tokens",
        "_request_id",
        "_started",
        "_state",
        "_stop_reason",
        "_text",
        "_token_ids",
        "_waiter",
    )

    def __init__(
        self,
        request_id: str,
        state: Any | None,
        *,
        detokenize: bool,
        prompt_tokens: int,
        receiver: DirectReceiver | None = None,
    ) -> None:
        """Takes over `state`; None: vLLM already dropped it (see `absorb`). `receiver`:
        where plain steps go direct, for a request the adapter found takes them
        (direct.takes_direct_steps), by the rule of direct.py."""
        self._request_id = request_id
        self._state = state
        self._prompt_tokens = prompt_tokens
        # vLLM's rule, per request: the first tokens at once, then every `interval`
        # tokens, the finish at once (RequestState.stream_interval folds in the
        # engine-wide --stream-interval).
        self._interval: int = max(1, state.stream_interval) if state is not None else 1
        self._detokenizer = state.detokenizer if detokenize and state is not None else None
        self._direct = DirectSteps(receiver)
        self._token_ids: list[int] = []
        self._text: list[str] = []
        self._finish: Any = None  # vLLM's FinishReason (or its string form) once finished
        self._stop_reason: int | str | None = None
        self._kv_transfer_params: dict[str, Any] | None = None
        self._error: BaseException | None = None
        self._error_detail: Any = None
        self._failed = False
        self._started = False
        self._waiter: asyncio.Future[None] | None = None
        if state is not None:
            state.make_request_output = self._on_output
            state.queue = self

    @property
    def finished(self) -> bool:
        return self._finish is not None

    def plain_step(self, new_token_ids: list[int]) -> None:
        """A plain step (fast_outputs.py): given direct to the consumer's receiver if the
        rule allows (direct.py), else buffered as any step."""
        if self._failed or not self._direct.give(
            new_token_ids,
            first=not self._started,
            waiting=self._waiter is not None,
            buffered=bool(self._token_ids),
        ):
            self._on_output(new_token_ids, None, None, None)

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
        """vLLM's RequestState.make_request_output, for this request (see compat.py).

        It runs inside AsyncLLM's output handler, where an exception would mark the
        whole engine errored: a failure here fails this request alone (its consumer
        raises it, and leaving early aborts the request in the engine).
        Returning None tells the OutputProcessor there is nothing to queue.
        """
        if self._failed:
            return
        try:
            self._take(new_token_ids, finish_reason, stop_reason, kv_transfer_params, error)
        except Exception as exc:
            self._failed = True
            logger.exception("lean output handler failed for request %s", self._request_id)
            self._error = RuntimeError(
                f"the output handler failed for this request: {type(exc).__name__}: {exc}"
            )
            self._wake()

    def _take(
        self,
        new_token_ids: list[int],
        finish_reason: Any,
        stop_reason: int | str | None,
        kv_transfer_params: dict[str, Any] | None,
        error: Any,
    ) -> None:
        self._token_ids += new_token_ids
        finished = finish_reason is not None
        if self._detokenizer is not None:
            text = self._detokenizer.get_next_output_text(finished, True)
            if text:
                self._text.append(text)
        if finished:
            self._finish = finish_reason
            self._stop_reason = stop_reason
            self._kv_transfer_params = kv_transfer_params
            self._error_detail = error
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
        """The OutputProcessor's queue interface: only exceptions arrive here (engine death;
        since vLLM 0.33 also a request the engine refused, e.g. while paused)."""
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
        direct = self._direct
        direct.count(token_ids)
        finish, stop_reason, error = finish_of(
            self._finish, self._stop_reason, direct.last_token, self._error_detail
        )
        step = EngineStep(
            token_ids=token_ids,
            text="".join(self._text) if self._text else "",
            finished=finish is not None,
            finish_reason=finish,
            stop_reason=stop_reason,
            prompt_tokens=self._prompt_tokens,
            completion_tokens=direct.produced,
            cached_tokens=self._state.num_cached_tokens if self._state is not None else 0,
            kv_transfer_params=self._kv_transfer_params,
            error=error,
        )
        if finish is not None and self._state is not None:
            # vLLM sets it on the request state from the finishing engine output.
            step.spec_decode = spec_decode_of(getattr(self._state, "spec_decode_metrics", None))
        self._text.clear()
        self._started = True
        return step
