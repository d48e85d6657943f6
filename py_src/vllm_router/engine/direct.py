"""Direct steps: an engine gives a plain step straight to its consumer's receiver.

The words used on this path (docs/architecture.md#glossary-the-direct-path):

- A *plain step* is a request's decode step that carries new token ids and nothing else:
  not its first, not its last (which carries the finish), no logprobs, no text.
- An engine yields a request's steps to the task that consumes them; each yield wakes that
  task. A plain step can instead go *direct*: from the engine's output loop to the
  *receiver* the consumer gave (`AsyncEngine.generate`'s `receiver`), and no task wakes.
- The receivers: a batched stream's `Lane` (core/batching.py), and a single-request
  stream's `Flight`, which renders the step into the stream's next message and passes it
  to the transport's *direct send* (core/flight.py).

Whether a step goes direct is decided here alone, in two questions every engine (the vLLM
adapter's LeanStream, the mock) asks and no consumer answers:

- Which requests (`takes_direct_steps`): those that make nothing but token ids at every
  step: one plain sample, no text, streamed at every step.
- Which steps (`DirectSteps.give`): plain steps only, never the request's first, and only
  while the consumer waits for the next step with nothing buffered for it: the receiver's
  tokens then come after everything yielded before and before everything yielded after.

The receiver may refuse (returns False: a direct send the transport cannot take now, or
whose stream has closed); the engine then buffers the step and yields it as any other,
merged with the steps after it while the consumer is busy (so a refused step is never lost,
and a consumer that falls behind is handed fewer, larger steps). The request's tokens are
counted once, here (`DirectSteps.produced`): the receiver is told the count with each step
it is given, and every step yielded later carries it as its `completion_tokens`, whether
its tokens went direct or were yielded.
"""

from __future__ import annotations

from collections.abc import Callable

from .types import SamplingOptions, one_plain_sample

# Called by the engine from its output loop with a plain step's new token ids (a list the
# receiver may keep: the engine does not touch it again) and the request's completion
# tokens with them. Returns whether it took them; it must never block or raise.
DirectReceiver = Callable[[list[int], int], bool]


def takes_direct_steps(
    options: SamplingOptions, samples: int, *, detokenize: bool, engine_interval: int
) -> bool:
    """Whether a request's plain steps may go direct at all: one plain sample (no logprobs
    of any kind), token-only, every step streamed (neither the request's stream interval
    nor the engine's own, `engine_interval`, merges steps)."""
    interval = max(options.stream_interval or 1, engine_interval)
    return interval == 1 and not detokenize and one_plain_sample(options, samples)


class DirectSteps:
    """One request's side of the direct path: its receiver (None: nothing goes direct) and
    the count of every token the request produced, given direct or yielded."""

    __slots__ = ("last_token", "produced", "receiver")

    def __init__(self, receiver: DirectReceiver | None) -> None:
        self.receiver = receiver
        self.produced = 0
        self.last_token: int | None = None

    def give(self, token_ids: list[int], *, first: bool, waiting: bool, buffered: bool) -> bool:
        """Give a plain step to the receiver: True if it took it (counted here), False if the
        engine must buffer it and yield it as any step (`first`: the consumer has not taken
        the request's first step yet; `waiting`: the consumer waits for the next step now;
        `buffered`: something is buffered for it)."""
        receiver = self.receiver
        if receiver is None or first or not waiting or buffered or not token_ids:
            return False
        produced = self.produced + len(token_ids)
        if not receiver(token_ids, produced):
            return False
        self.produced = produced
        self.last_token = token_ids[-1]
        return True

    def count(self, token_ids: list[int]) -> None:
        """Tokens the request produced in a step the engine yields."""
        if token_ids:
            self.produced += len(token_ids)
            self.last_token = token_ids[-1]
