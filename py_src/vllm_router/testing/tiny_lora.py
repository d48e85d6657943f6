"""Build a random-weight LoRA adapter for a tiny model (PEFT layout, no peft needed).

    python -m vllm_router.testing.tiny_lora MODEL_DIR OUT_DIR [--seed N]

Writes `adapter_config.json` and `adapter_model.safetensors` with seeded random
A and B matrices for q_proj and v_proj of every layer, large enough that the
adapter visibly changes the model's output. Same arguments -> same bytes.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

RANK = 8
ALPHA = 16
SCALE = 0.5
TARGETS = ("q_proj", "v_proj")


def build_tiny_lora(model_dir: str | Path, out_dir: str | Path, seed: int = 1) -> Path:
    import torch
    from safetensors.torch import save_file

    config = json.loads(Path(model_dir, "config.json").read_text())
    hidden = config["hidden_size"]
    head_dim = hidden // config["num_attention_heads"]
    outputs = {"q_proj": hidden, "v_proj": config["num_key_value_heads"] * head_dim}
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module in TARGETS:
            base = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            shapes = {"lora_A": (RANK, hidden), "lora_B": (outputs[module], RANK)}
            for part, shape in shapes.items():
                weights = torch.randn(*shape, generator=generator) * SCALE
                tensors[f"{base}.{part}.weight"] = weights.to(torch.bfloat16)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": RANK,
        "lora_alpha": ALPHA,
        "lora_dropout": 0.0,
        "target_modules": list(TARGETS),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "base_model_name_or_path": str(model_dir),
    }
    (out / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2) + "\n")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    print(build_tiny_lora(args.model_dir, args.out_dir, args.seed))


if __name__ == "__main__":
    main()
