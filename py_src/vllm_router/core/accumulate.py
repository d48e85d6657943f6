"""A whole request collected from its engine steps, for answers sent once it has finished."""

from __future__ import annotations

from ..engine import EngineStep, TokenLogprob


class SampleResult:
    """One sample's tokens, text and logprobs, and its last (finished) step."""

    __slots__ = ("last", "logprobs", "text", "token_ids")

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.text: list[str] = []
        self.logprobs: list[TokenLogprob] | None = None
        self.last: EngineStep | None = None

    def add(self, step: EngineStep) -> None:
        self.token_ids.extend(step.token_ids)
        if step.text:
            self.text.append(step.text)
        if step.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(step.logprobs)
        self.last = step

    @property
    def output_text(self) -> str:
        return "".join(self.text)


class RequestResult:
    """Every sample of one request, by index, and the prompt logprobs if asked for."""

    __slots__ = ("prompt_logprobs", "samples")

    def __init__(self) -> None:
        self.samples: dict[int, SampleResult] = {}
        self.prompt_logprobs: list[TokenLogprob] | None = None

    def add(self, step: EngineStep) -> None:
        sample = self.samples.get(step.index)
        if sample is None:
            sample = self.samples[step.index] = SampleResult()
        sample.add(step)
        if step.prompt_logprobs is not None:
            self.prompt_logprobs = step.prompt_logprobs

    def in_order(self) -> list[tuple[int, SampleResult]]:
        return sorted(self.samples.items())

    def lasts(self) -> list[EngineStep]:
        """The finished step of every sample, in index order."""
        return [s.last for _, s in self.in_order() if s.last is not None]
