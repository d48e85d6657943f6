"""What a vLLM engine says about its model: ModelFacts, and its tokenizer files."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..types import ModelFacts

if TYPE_CHECKING:
    from vllm.v1.engine.async_llm import AsyncLLM

# What GetTokenizer sends, when the model directory has it.
TOKENIZER_FILES = (
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


def read_tokenizer_files(tokenizer: str) -> list[tuple[str, bytes]]:
    source = Path(tokenizer)
    if not source.is_dir():  # a hub id: the files are in the local hub cache
        from huggingface_hub import snapshot_download

        source = Path(snapshot_download(tokenizer, local_files_only=True))
    return [(name, (source / name).read_bytes()) for name in TOKENIZER_FILES
            if (source / name).is_file()]  # fmt: skip


def model_facts(llm: AsyncLLM, model_defaults: dict[str, Any]) -> ModelFacts:
    import vllm

    vllm_config = llm.vllm_config
    model_config = vllm_config.model_config
    tokenizer = llm.get_tokenizer() if not model_config.skip_tokenizer_init else None
    eos_ids = set()
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        eos_ids.add(tokenizer.eos_token_id)
    generation_eos = model_config.try_get_generation_config().get("eos_token_id")
    if generation_eos is not None:
        eos_ids.update([generation_eos] if isinstance(generation_eos, int) else generation_eos)
    served = model_config.served_model_name or model_config.model
    kv = vllm_config.kv_transfer_config
    return ModelFacts(
        model_name=model_config.model,
        served_model_name=served if isinstance(served, str) else served[0],
        max_model_len=model_config.max_model_len,
        vocab_size=model_config.get_vocab_size(),
        dp_size=vllm_config.parallel_config.data_parallel_size,
        block_size=vllm_config.cache_config.block_size,
        eos_token_ids=tuple(sorted(eos_ids)),
        engine="vllm",
        engine_version=vllm.__version__,
        max_num_seqs=vllm_config.scheduler_config.max_num_seqs,
        bos_token_id=getattr(tokenizer, "bos_token_id", None),
        pad_token_id=getattr(tokenizer, "pad_token_id", None),
        architectures=tuple(model_config.architectures or ()),
        is_generation=model_config.runner_type == "generate",
        default_sampling_params=model_defaults,
        supports_priority=vllm_config.scheduler_config.policy == "priority",
        supports_lora=vllm_config.lora_config is not None,
        tokenizer_path=str(model_config.tokenizer),
        model_type=str(getattr(model_config.hf_config, "model_type", "") or ""),
        kv_connector=str(getattr(kv, "kv_connector", "") or ""),
        kv_role=str(getattr(kv, "kv_role", "") or ""),
        kv_engine_id=str(getattr(kv, "engine_id", "") or ""),
        kv_cache_dtype=str(vllm_config.cache_config.cache_dtype or ""),
        model_dtype=str(model_config.dtype),
    )
