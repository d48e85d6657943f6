"""The test models' builders refuse a checkpoint vLLM would serve with an output head it
never loaded (no engine: transformers only)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from vllm_router.testing import tiny_model

from harness import require

# The two levels of an Idefics3 config: (top level, text config) -> what the build says.
CASES = [
    ((False, False), None),
    # Tied only at the top level: transformers ties and saves no lm_head; vLLM builds the
    # head untied (text config) and never loads it.
    ((True, False), "tie_word_embeddings is True at the top level but False"),
    # Tied only in the text config: vLLM ties the head and drops the one saved.
    ((False, True), "tie_word_embeddings is False at the top level but True"),
]


def _save_idefics3(out: Path, top: bool, text: bool) -> None:
    import torch
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration

    config = Idefics3Config(
        vision_config=dict(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            image_size=32, patch_size=16,
        ),
        text_config=dict(
            model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64,
            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
            tie_word_embeddings=text,
        ),
        tie_word_embeddings=top,
    )  # fmt: skip
    torch.manual_seed(0)
    Idefics3ForConditionalGeneration(config).save_pretrained(out, safe_serialization=True)


@pytest.mark.parametrize(("ties", "refused"), CASES)
def test_a_head_tied_at_one_level_only_is_refused(
    tmp_path: Path, ties: tuple[bool, bool], refused: str | None
) -> None:
    require(importlib.util.find_spec("transformers") is not None, "transformers is not installed")
    _save_idefics3(tmp_path, *ties)
    if refused is None:
        tiny_model.check_output_head(tmp_path)
        return
    with pytest.raises(RuntimeError, match=refused):
        tiny_model.check_output_head(tmp_path)


def test_an_untied_head_that_was_not_saved_is_refused(tmp_path: Path) -> None:
    require(importlib.util.find_spec("transformers") is not None, "transformers is not installed")
    from safetensors.torch import load_file, save_file

    _save_idefics3(tmp_path, False, False)
    weights = tmp_path / "model.safetensors"
    tensors = load_file(str(weights))
    del tensors["lm_head.weight"]
    save_file(tensors, str(weights), metadata={"format": "pt"})
    with pytest.raises(RuntimeError, match=r"no lm_head\.weight was saved"):
        tiny_model.check_output_head(tmp_path)
