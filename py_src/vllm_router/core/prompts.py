"""Prompt checks that need only the model's facts; they apply to every contract and engine."""

from __future__ import annotations

from ..engine import ModelFacts
from ..errors import InvalidRequest


def check_prompt(
    prompt_ids: list[int],
    max_tokens: int | None,
    facts: ModelFacts,
    *,
    max_prompt_tokens: int = 0,
    field_name: str = "prompt_token_ids",
) -> None:
    """Reject a prompt the engine cannot run: empty, out of vocabulary, too long.

    `max_prompt_tokens` (0: no limit) is the operator's admission limit.
    """
    if not prompt_ids:
        raise InvalidRequest(f"the prompt is empty: {field_name} has no tokens")
    if max_prompt_tokens and len(prompt_ids) > max_prompt_tokens:
        raise InvalidRequest(
            f"{field_name} has {len(prompt_ids)} tokens; this server admits at most "
            f"{max_prompt_tokens} (--max-prompt-tokens)"
        )
    top = max(prompt_ids)
    if top >= facts.vocab_size:
        raise InvalidRequest(
            f"{field_name}[{prompt_ids.index(top)}] = {top} is outside the vocabulary "
            f"(valid ids are 0..{facts.vocab_size - 1})"
        )
    if len(prompt_ids) >= facts.max_model_len:
        raise InvalidRequest(
            f"{field_name} has {len(prompt_ids)} tokens; the prompt must be shorter than "
            f"max_model_len {facts.max_model_len} to leave room for at least one output token"
        )
    if max_tokens is not None and len(prompt_ids) + max_tokens > facts.max_model_len:
        raise InvalidRequest(
            f"sampling_params.max_tokens {max_tokens} plus the {len(prompt_ids)} tokens of "
            f"{field_name} "
            f"exceeds max_model_len {facts.max_model_len}; ask for at most "
            f"{facts.max_model_len - len(prompt_ids)} tokens"
        )
