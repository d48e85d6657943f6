"""The decode-step hand-off: when an engine gives a plain decode step to its consumer's sink.

An engine yields a request's steps to the task that consumes them; each yield wakes that
task. A plain decode step (new token ids and nothing else) can instead go straight from the
engine's output loop to a `TokenSink` the consumer gave (`AsyncEngine.generate`'s
`decoded`): a batched stream's lane, or a single-request stream's direct send. The rule for
when it may, declared once here and used by every engine (the vLLM adapter's LeanStream and
the mock):

- Only requests that make nothing but token ids at every step (`hands_over`): one plain
  sample, no text, streamed at every step. Others never offer.
- A step is offered only when it is not the request's first or last, the consumer is
  waiting for the next step and nothing is buffered for it: the sink's tokens then come
  after everything yielded before and before everything yielded after (order).
- The sink may refuse (returns False: a direct send whose client window is full, or whose
  stream has closed); the engine then buffers the step and yields it as any other, merged
  with the steps after it while the consumer is busy (so a refused step is never lost, and
  a consumer that falls behind is handed fewer, larger steps).
- Tokens the sink took count in the request's `completion_tokens` of every later step, as
  if they had been yielded: the engine counts them (`Handoff.produced`).
"""

from __future__ import annotations

from collections.abc import Callable

from .types import SamplingOptions, one_plain_sample

# Called by the engine from its output loop with a plain decode step's new token ids (a list
# the sink may keep: the engine does not touch it again). Returns whether it took them;
# it must never block or raise.
TokenSink = Callable[[list[int]], bool]


def hands_over(options: SamplingOptions, samples: int, *, detokenize: bool) -> bool:
    """Whether a request's decode steps may be offered to a sink at all: one plain sample
    (no logprobs of any kind), token-only, every step streamed (no stream interval)."""
    interval = options.stream_interval or 1
    return interval == 1 and not detokenize and one_plain_sample(options, samples)


class Handoff:
    """One request's side of the hand-off: its sink (None: it never offers) and the count of
    every token the request produced, offered or buffered (`completion_tokens`)."""

    __slots__ = ("last_token", "produced", "sink")

    def __init__(self, sink: TokenSink | None) -> None:
        self.sink = sink
        self.produced = 0
        self.last_token: int | None = None

    def offer(self, token_ids: list[int], *, started: bool, waiting: bool, buffered: bool) -> bool:
        """Offer a decode step that is not the request's last: True if the sink took it
        (counted here), False if the engine must buffer it and yield it as any step
        (`started`: the consumer has taken the request's first step; `waiting`: it waits
        for the next now; `buffered`: something is buffered for it)."""
        sink = self.sink
        if sink is None or not token_ids or not started or not waiting or buffered:
            return False
        if not sink(token_ids):
            return False
        self.count(token_ids)
        return True

    def count(self, token_ids: list[int]) -> None:
        """Tokens the request produced (taken by the sink, or yielded in a step)."""
        if token_ids:
            self.produced += len(token_ids)
            self.last_token = token_ids[-1]
