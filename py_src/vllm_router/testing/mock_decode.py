"""One sample of a mock request, decoded step by step (deterministic, no model).

Sample i of a request continues the prompt with (last prompt token + 1 + i), then
counts up. A logit bias of +100 forces that token every time; -100 bans it (the
count skips it). A `choice` constraint emits the first choice's UTF-8 bytes (mod
vocab_size) as tokens, then EOS, with the choice as its text. `every_interval` merges
steps as vLLM's stream_interval does.
"""

from __future__ import annotations

import codecs
import dataclasses
from collections.abc import AsyncIterator, Callable

from ..engine import EngineStep, ModelFacts, SamplingOptions
from ..engine.types import FinishReason
from ..errors import Unsupported
from .mock_config import FAULT_FINISHES, MockConfig
from .mock_sampling import mock_token_text
from .stop_strings import StopStringMatcher

# vLLM clamps logit_bias to [-100, 100]; the mock can honour only the two ends.
FORCE, BAN = 100.0, -100.0


def check_supported(s: SamplingOptions) -> None:
    """Refuse what the mock cannot do honestly (UNIMPLEMENTED, naming the mock)."""
    unsupported = [
        name
        for name, value in (
            ("prompt_logprobs", s.prompt_logprobs),
            ("logprob_token_ids", s.logprob_token_ids),
            ("allowed_token_ids", s.allowed_token_ids),
            ("bad_words", s.bad_words),
        )
        if value not in (None, ())
    ]
    constraint = s.structured_outputs
    if constraint is not None and constraint.choice is None:
        unsupported.append("structured_outputs other than choice")
    if s.logit_bias and any(b not in (FORCE, BAN) for b in s.logit_bias.values()):
        unsupported.append("logit_bias values other than +100 (forced) and -100 (banned)")
    if unsupported:
        raise Unsupported(f"the mock engine does not implement {', '.join(unsupported)}")


def cached_prefix(cached_blocks: set[tuple[int, ...]], prompt: list[int], block_size: int) -> int:
    """Prompt tokens in whole blocks seen before (then remembers this prompt's blocks)."""
    cached = 0
    for end in range(block_size, len(prompt) + 1, block_size):
        key = tuple(prompt[:end])
        if key in cached_blocks:
            cached = end
        else:
            cached_blocks.add(key)
    return cached


class SampleDecoder:
    def __init__(
        self,
        index: int,
        prompt: list[int],
        sampling: SamplingOptions,
        facts: ModelFacts,
        config: MockConfig,
        detokenize: bool,
    ) -> None:
        self.index = index
        self._fault_finish = FAULT_FINISHES[config.fault_finish_reason]
        eos_token_id = config.eos_token_id
        self.generated = 0
        self._s = sampling
        self._vocab = facts.vocab_size
        self._eos = eos_token_id
        self._detokenize = detokenize
        # As vLLM's scheduler: a sample ends with "length" when the context is full.
        room = facts.max_model_len - len(prompt)
        self._max_tokens = room if sampling.max_tokens is None else min(sampling.max_tokens, room)
        self._matcher = StopStringMatcher(sampling.stop, bool(sampling.include_stop_str_in_output))
        bias = sampling.logit_bias or {}
        forced = sorted(t for t, b in bias.items() if b >= FORCE)
        self._forced = forced[0] if forced else None
        self._banned = {t for t, b in bias.items() if b <= BAN}
        self._next = (prompt[-1] + 1 + index) % self._vocab
        constraint = sampling.structured_outputs
        choice = constraint.choice[0] if constraint and constraint.choice else None
        self._plan = [b % self._vocab for b in choice.encode()] if choice is not None else None
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def _next_token(self) -> int:
        if self._plan is not None:
            return self._plan.pop(0) if self._plan else self._eos
        if self._forced is not None:
            return self._forced
        while self._next in self._banned:
            self._next = (self._next + 1) % self._vocab
        token, self._next = self._next, (self._next + 1) % self._vocab
        return token

    def _text_of(self, token: int) -> str:
        if self._plan is not None:
            return self._utf8.decode(bytes([token]))
        return mock_token_text(token)

    def step(
        self, tokens_per_step: int, on_token: Callable[[], None]
    ) -> tuple[list[int], str, FinishReason | None, int | str | None]:
        """One engine step: (new token ids, their text, finish reason, what stopped it)."""
        s = self._s
        new_ids: list[int] = []
        pieces: list[str] = []
        finish: FinishReason | None = None
        stop_reason: int | str | None = None
        for _ in range(tokens_per_step):
            token = self._next_token()
            new_ids.append(token)
            self.generated += 1
            on_token()
            eligible = self.generated > (s.min_tokens or 0)
            if eligible and (
                token in s.stop_token_ids or (token == self._eos and not s.ignore_eos)
            ):
                finish, stop_reason = "stop", token
            elif self._detokenize and not (
                token == self._eos and s.skip_special_tokens is not False
            ):
                text, matched = self._matcher.feed(self._text_of(token), may_stop=eligible)
                pieces.append(text)
                if matched is not None:
                    finish, stop_reason = "stop", matched
            if finish is None and self.generated >= self._max_tokens:
                finish = "length"
            if finish is None and self._fault_finish is not None and self.generated >= 2:
                finish = self._fault_finish
            if finish is not None:
                pieces.append(self._matcher.flush())
                break
        return new_ids, "".join(pieces), finish, stop_reason


async def every_interval(
    steps: AsyncIterator[EngineStep], interval: int
) -> AsyncIterator[EngineStep]:
    """Merge each sample's steps into one per `interval` tokens, as vLLM's stream_interval:
    a sample's first step and its finished step are never held back."""
    if interval <= 1:
        async for step in steps:
            yield step
        return
    pending: dict[int, EngineStep] = {}
    sent: set[int] = set()
    async for step in steps:
        held = pending.pop(step.index, None)
        if held is not None:
            step = dataclasses.replace(
                step,
                token_ids=held.token_ids + step.token_ids,
                text=held.text + step.text,
                logprobs=(held.logprobs or []) + (step.logprobs or []) if step.logprobs else None,
                prompt_logprobs=held.prompt_logprobs or step.prompt_logprobs,
            )
        if step.index not in sent or step.finished or len(step.token_ids) >= interval:
            sent.add(step.index)
            yield step
        else:
            pending[step.index] = step
