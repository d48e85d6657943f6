"""The mock engine's sampling: vLLM's validation rules for it, token text and logprobs.

The rules restate vLLM's SamplingParams checks (same messages) for the values a
request can reach an engine with; a test holds them against vLLM's own.
"""

from __future__ import annotations

import math

from ..engine import SamplingOptions, TokenLogprob
from ..errors import InvalidRequest

MAX_LOGPROBS = 20
MAX_TEMPERATURE = 2.0


def mock_token_text(token_id: int) -> str:
    return f" {token_id}"


def validate_sampling(s: SamplingOptions, detokenize: bool) -> None:
    """vLLM's SamplingParams rules (and messages) for values a request can carry here."""

    def check(ok: bool, message: str) -> None:
        if not ok:
            raise InvalidRequest(message)

    for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty",
                 "repetition_penalty"):  # fmt: skip
        value = getattr(s, name)
        check(
            value is None or math.isfinite(value), f"{name} must be a finite number, got {value}."
        )
    if s.temperature is not None:
        check(
            0.0 <= s.temperature <= MAX_TEMPERATURE,
            f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {s.temperature}.",
        )
    if s.top_p is not None:
        check(0.0 < s.top_p <= 1.0, f"top_p must be in (0, 1], got {s.top_p}.")
    if s.top_k is not None:
        check(s.top_k >= -1, f"top_k must be 0 (disable), or at least 1, got {s.top_k}.")
    if s.min_p is not None:
        check(0.0 <= s.min_p <= 1.0, f"min_p must be in [0, 1], got {s.min_p}.")
    for name in ("frequency_penalty", "presence_penalty"):
        value = getattr(s, name)
        check(value is None or -2.0 <= value <= 2.0, f"{name} must be in [-2, 2], got {value}.")
    if s.repetition_penalty is not None:
        check(
            s.repetition_penalty > 0.0,
            f"repetition_penalty must be greater than zero, got {s.repetition_penalty}.",
        )
    if s.stream_interval is not None:
        check(
            s.stream_interval >= 1, f"stream_interval must be at least 1, got {s.stream_interval}."
        )
    if s.max_tokens is not None:
        check(s.max_tokens >= 1, f"max_tokens must be at least 1, got {s.max_tokens}.")
        check(
            s.min_tokens is None or s.min_tokens <= s.max_tokens,
            f"min_tokens must be less than or equal to max_tokens={s.max_tokens}, "
            f"got {s.min_tokens}.",
        )
    if s.n is not None:
        check(s.n >= 1, f"n must be at least 1, got {s.n}.")
    if s.logprobs is not None:
        check(
            0 <= s.logprobs <= MAX_LOGPROBS,  # -1 (whole vocabulary) is past the limit too
            f"Requested sample logprobs of {s.logprobs}, which is greater than max allowed: "
            f"{MAX_LOGPROBS}",
        )
    check(
        not s.stop or detokenize,
        "stop strings are only supported when detokenize is True. Set detokenize=True to use stop.",
    )


def mock_logprobs(token_ids: list[int], k: int, vocab_size: int) -> list[TokenLogprob]:
    """-0.5 for each sampled token; its j-th alternative is (id + j, -0.5 - j)."""
    return [
        TokenLogprob(
            token_id=t,
            logprob=-0.5,
            top=tuple(((t + j) % vocab_size, -0.5 - j) for j in range(k)),
        )
        for t in token_ids
    ]
