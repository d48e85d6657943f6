"""Build a tiny Idefics3 vision-language checkpoint from nothing (no hub, no download).

    python -m vllm_router.testing.tiny_vlm DIR

The text half is the tiny Llama of `tiny_model` (same tokenizer, same shape),
the vision half a 2-layer SigLIP-style encoder on 64 px images cut into 16 px
patches; pixel shuffle by `scale_factor` 2 leaves 4 `<image>` tokens per image.
Images are never split into tiles (`do_image_splitting=False`), so every image,
whatever its size, becomes the same 7 prompt tokens:
`<fake_token_around_image><global-img><image>*4<fake_token_around_image>`.
A prompt carries one `<image>` marker per image, which vLLM expands (the first
markers it finds: an already-expanded prompt gets expanded again).

The weights are seeded random numbers and everything is saved with
`save_pretrained`, so vLLM loads it like any Hugging Face model (the image
processor is transformers' PIL backend: there is no torchvision here). Every
build gives byte-identical files. A finished build is marked with a
fingerprint and reused.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from pathlib import Path

from vllm_router.testing import tiny_model

RECIPE_VERSION = 1
VISION_HIDDEN, VISION_INTERMEDIATE, VISION_LAYERS, VISION_HEADS = 64, 128, 2, 2
IMAGE_SIZE, PATCH_SIZE, SCALE_FACTOR = 64, 16, 2
IMAGE_SEQ_LEN = (IMAGE_SIZE // PATCH_SIZE) ** 2 // SCALE_FACTOR**2  # <image> tokens per image
VISION_INIT_RANGE = 0.5  # as the text half: images visibly steer greedy output
FAKE_IMAGE_TOKEN = "<fake_token_around_image>"
IMAGE_TOKEN = "<image>"
GLOBAL_IMAGE_TOKEN = "<global-img>"
END_OF_UTTERANCE = "<end_of_utterance>"
IMAGE_SPECIAL_TOKENS = (FAKE_IMAGE_TOKEN, IMAGE_TOKEN, GLOBAL_IMAGE_TOKEN, END_OF_UTTERANCE)
# Content is a string or a list of OpenAI-style parts; an image part (`{"type": "image"}`,
# as vLLM's chat front end passes it, or a raw `image_url` part) becomes one <image> marker.
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: "
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for part in m['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] in ('image', 'image_url') %}" + IMAGE_TOKEN + "{% endif %}"
    # A newline right after a block tag would be eaten (trim_blocks): print it.
    "{% endfor %}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)


def image_prompt_tokens() -> str:
    """The text one `<image>` marker expands to (what vLLM puts in the prompt)."""
    return FAKE_IMAGE_TOKEN + GLOBAL_IMAGE_TOKEN + IMAGE_TOKEN * IMAGE_SEQ_LEN + FAKE_IMAGE_TOKEN


def _fingerprint() -> str:
    recipe = {
        "version": RECIPE_VERSION,
        "text": tiny_model._fingerprint({}),
        "vision": [VISION_HIDDEN, VISION_INTERMEDIATE, VISION_LAYERS, VISION_HEADS],
        "image": [IMAGE_SIZE, PATCH_SIZE, SCALE_FACTOR, VISION_INIT_RANGE],
        "tokens": IMAGE_SPECIAL_TOKENS,
        "template": CHAT_TEMPLATE,
    }
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()


def _build(out: Path) -> None:
    import torch
    from transformers import (
        GenerationConfig,
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessorPil,
        Idefics3Processor,
    )

    tokenizer = tiny_model._train_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": list(IMAGE_SPECIAL_TOKENS)})
    tokenizer.chat_template = CHAT_TEMPLATE
    image_processor = Idefics3ImageProcessorPil(
        do_image_splitting=False,
        size={"longest_edge": IMAGE_SIZE},
        max_image_size={"longest_edge": IMAGE_SIZE},
    )
    processor = Idefics3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        image_seq_len=IMAGE_SEQ_LEN,
        chat_template=CHAT_TEMPLATE,
    )
    # The processor re-registers three of the four, dropping <global-img> from the list.
    tokenizer.add_special_tokens({"additional_special_tokens": list(IMAGE_SPECIAL_TOKENS)})
    processor.save_pretrained(out)

    special = {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    text_config = dict(
        model_type="llama",
        vocab_size=len(tokenizer),
        hidden_size=tiny_model.HIDDEN,
        intermediate_size=tiny_model.INTERMEDIATE,
        num_hidden_layers=tiny_model.LAYERS,
        num_attention_heads=tiny_model.HEADS,
        num_key_value_heads=tiny_model.KV_HEADS,
        max_position_embeddings=tiny_model.MAX_POSITIONS,
        initializer_range=tiny_model.INIT_RANGE,
        tie_word_embeddings=False,
        **special,
    )
    vision_config = dict(
        hidden_size=VISION_HIDDEN,
        intermediate_size=VISION_INTERMEDIATE,
        num_hidden_layers=VISION_LAYERS,
        num_attention_heads=VISION_HEADS,
        image_size=IMAGE_SIZE,
        patch_size=PATCH_SIZE,
        initializer_range=VISION_INIT_RANGE,
    )
    config = Idefics3Config(
        vision_config=vision_config,
        text_config=text_config,
        scale_factor=SCALE_FACTOR,
        image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        tie_word_embeddings=False,
        **special,
    )
    torch.manual_seed(0)
    model = Idefics3ForConditionalGeneration(config)
    with torch.no_grad():
        model.lm_head.weight[tokenizer.eos_token_id] *= tiny_model.EOS_ROW_SCALE
    model.to(torch.bfloat16)  # type: ignore[arg-type]  # transformers mistypes .to
    model.generation_config = GenerationConfig(**special)
    model.save_pretrained(out, safe_serialization=True)
    tiny_model.check_output_head(out)


def build_tiny_vlm(out_dir: str | os.PathLike[str]) -> Path:
    """Build (or reuse) the checkpoint in `out_dir`; returns its path."""
    return tiny_model.build_once(out_dir, "tiny-vlm", _fingerprint(), _build)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", help="directory to build the checkpoint in (reused if built)")
    args = parser.parse_args()
    print(build_tiny_vlm(args.out_dir))


if __name__ == "__main__":
    main()
