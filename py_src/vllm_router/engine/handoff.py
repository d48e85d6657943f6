"""The hand-off: an engine gives a plain decode step straight to its consumer's sink.

An engine yields a request's steps to the task that consumes them; each yield wakes that
task. A plain decode step (new token ids and nothing else) can instead be handed off: it
goes straight from the engine's output loop to a `HandoffSink` the consumer gave
(`AsyncEngine.generate`'s `sink`), and no task wakes. The consumer's sinks: a batched
stream's `Lane` (core/batching.py), and a single-request stream's `Flight`, which renders
the step into the stream's next message and passes it to the transport's direct send
(core/flight.py). The rule for when a step may be handed off is this module's alone;
every engine (the vLLM adapter's LeanStream, the mock) asks it, and no consumer decides it:

- Which requests (`may_hand_off`): those that make nothing but token ids at every step:
  one plain sample, no text, streamed at every step. Others never offer.
- Which steps (`Handoff.offer`): never the request's first or last, and only while the
  consumer waits for the next step with nothing buffered for it: the sink's tokens then
  come after everything yielded before and before everything yielded after (order).
- The sink may refuse (returns False: a direct send whose client window is full, or whose
  stream has closed); the engine then buffers the step and yields it as any other, merged
  with the steps after it while the consumer is busy (so a refused step is never lost, and
  a consumer that falls behind is handed fewer, larger steps).
- The request's tokens are counted once, here (`Handoff.produced`): the sink is told the
  count with each step it is offered, and every step yielded later carries it as its
  `completion_tokens`, whether its tokens were handed off or yielded.
"""

from __future__ import annotations

from collections.abc import Callable

from .types import SamplingOptions, one_plain_sample

# Called by the engine from its output loop with a plain decode step's new token ids (a list
# the sink may keep: the engine does not touch it again) and the request's completion tokens
# with them. Returns whether it took them; it must never block or raise.
HandoffSink = Callable[[list[int], int], bool]


def may_hand_off(
    options: SamplingOptions, samples: int, *, detokenize: bool, engine_interval: int = 1
) -> bool:
    """Whether a request's decode steps may be handed off at all: one plain sample (no
    logprobs of any kind), token-only, every step streamed (neither the request's stream
    interval nor the engine's own, `engine_interval`, merges steps)."""
    interval = max(options.stream_interval or 1, engine_interval)
    return interval == 1 and not detokenize and one_plain_sample(options, samples)


class Handoff:
    """One request's side of the hand-off: its sink (None: it never offers) and the count of
    every token the request produced, handed off or yielded (`completion_tokens`)."""

    __slots__ = ("last_token", "produced", "sink")

    def __init__(self, sink: HandoffSink | None) -> None:
        self.sink = sink
        self.produced = 0
        self.last_token: int | None = None

    def offer(
        self, token_ids: list[int], *, first: bool, last: bool, waiting: bool, buffered: bool
    ) -> bool:
        """Offer a decode step: True if the sink took it (counted here), False if the engine
        must buffer it and yield it as any step (`first`: the consumer has not taken the
        request's first step yet; `last`: this step ends the request; `waiting`: the
        consumer waits for the next step now; `buffered`: something is buffered for it)."""
        sink = self.sink
        if sink is None or first or last or not waiting or buffered or not token_ids:
            return False
        produced = self.produced + len(token_ids)
        if not sink(token_ids, produced):
            return False
        self.produced = produced
        self.last_token = token_ids[-1]
        return True

    def count(self, token_ids: list[int]) -> None:
        """Tokens the request produced in a step the engine yields."""
        if token_ids:
            self.produced += len(token_ids)
            self.last_token = token_ids[-1]
