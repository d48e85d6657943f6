"""Build a tiny Llama-architecture checkpoint from nothing (no hub, no download).

    python -m vllm_router.testing.tiny_model DIR [--generation-temperature T]

A byte-level BPE tokenizer is trained on the text below, the weights are
seeded random numbers, and everything is saved with `save_pretrained`, so vLLM
loads it like any Hugging Face model. Same arguments -> byte-identical files.
A finished build is marked with a fingerprint and reused.

The output is meant to be *varied* (not one token repeated), and the EOS
token's output row is scaled up so greedy decoding ends with a real "stop"
now and then.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

RECIPE_VERSION = 1
HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS = 128, 256, 2, 2, 1  # head_dim 64 (CPU kernels)
MAX_POSITIONS = 2048
VOCAB_TARGET = 512
INIT_RANGE = 0.5
EOS_ROW_SCALE = 1.6
SPECIAL_TOKENS = ("<s>", "</s>", "<pad>")
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)
CORPUS = """\
A router sends token ids to a worker and reads token ids back.
The worker runs an engine that schedules many requests at once.
Each step of the engine produces one new token for every running request.
When a client goes away the request is aborted and its memory is freed.
Health checks tell the load balancer which workers can take more work.
The cache keeps the keys and values of prompts that were seen before.
Small models are useful for tests because they load in a few seconds.
Numbers like 1, 2, 3, 10, 42 and 2048 appear in logs and in metrics.
Streams carry text deltas, finish reasons, usage counts and load signals.
Good servers drain in-flight work before they stop, then exit cleanly.
"""


def _fingerprint(generation_defaults: dict[str, Any]) -> str:
    recipe = {
        "version": RECIPE_VERSION,
        "shape": [HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS, MAX_POSITIONS, VOCAB_TARGET],
        "init": [INIT_RANGE, EOS_ROW_SCALE],
        "corpus": CORPUS,
        "template": CHAT_TEMPLATE,
        "generation": generation_defaults,
    }
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()


def _train_tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_TARGET,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    bos_id = tokenizer.token_to_id("<s>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos_id)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _build(out: Path, generation_defaults: dict[str, Any]) -> None:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    tokenizer = _train_tokenizer()
    tokenizer.save_pretrained(out)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=MAX_POSITIONS,
        initializer_range=INIT_RANGE,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight[tokenizer.eos_token_id] *= EOS_ROW_SCALE
    model.to(torch.bfloat16)  # type: ignore[arg-type]  # transformers mistypes .to
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        # Transformers refuses to save sampling defaults unless sampling is on.
        do_sample=bool(generation_defaults),
        **generation_defaults,
    )
    model.save_pretrained(out, safe_serialization=True)
    check_output_head(out)


def check_output_head(out: Path) -> None:
    """Refuse a checkpoint vLLM would serve with an output head it never loaded.

    vLLM's language model ties `lm_head` to the embeddings as the *text* config says,
    while transformers saves (or, when tied, leaves out) `lm_head` as the top level says.
    A nested config (Idefics3) whose two levels disagree is saved without the head vLLM
    then builds untied, or with one vLLM ignores: random or NaN logits on every worker,
    identical on all of them, so comparisons between workers cannot see it.
    """
    from safetensors import safe_open
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(out)
    tied = bool(config.get_text_config().tie_word_embeddings)
    if bool(config.tie_word_embeddings) != tied:
        raise RuntimeError(
            f"{out}: tie_word_embeddings is {config.tie_word_embeddings} at the top level "
            f"but {tied} in the text config (vLLM ties by the text config)"
        )
    if tied:
        return
    names: set[str] = set()
    for shard in out.glob("*.safetensors"):
        with safe_open(str(shard), "pt") as tensors:
            names.update(tensors.keys())
    if "lm_head.weight" not in names:
        raise RuntimeError(f"{out}: the output head is untied but no lm_head.weight was saved")


def build_once(
    out_dir: str | os.PathLike[str], name: str, fingerprint: str, build: Callable[[Path], None]
) -> Path:
    """`build(directory)` into `out_dir` unless a build with this fingerprint is there.

    Built in a staging directory and renamed into place: a half-built checkpoint is
    never reused. `name` names the marker file and the staging directory.
    """
    out = Path(out_dir).resolve()
    marker = out / f".{name}-fingerprint"
    if marker.exists() and marker.read_text() == fingerprint:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=out.parent))
    try:
        build(staging)
        (staging / marker.name).write_text(fingerprint)
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def build_tiny_model(out_dir: str | os.PathLike[str], **generation_defaults: Any) -> Path:
    """Build (or reuse) the checkpoint in `out_dir`; returns its path.

    `generation_defaults` (e.g. temperature=0.7) go into generation_config.json,
    which vLLM applies to sampling fields a request leaves unset.
    """
    return build_once(
        out_dir,
        "tiny-model",
        _fingerprint(generation_defaults),
        lambda staging: _build(staging, generation_defaults),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", help="directory to build the checkpoint in (reused if built)")
    parser.add_argument(
        "--generation-temperature",
        type=float,
        help="write this default temperature into generation_config.json",
    )
    args = parser.parse_args()
    defaults = {}
    if args.generation_temperature is not None:
        defaults["temperature"] = args.generation_temperature
    path = build_tiny_model(args.out_dir, **defaults)
    print(path)


if __name__ == "__main__":
    main()
