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


# Connectors that move KV from the prefill engine straight to the decode engine, and
# those through which both meet in a shared store (by vLLM's class names).
PEER_CONNECTORS = frozenset({"NixlConnector", "MooncakeConnector", "MoRIIOConnector",
                             "P2pNcclConnector"})  # fmt: skip
STORE_CONNECTORS = frozenset({"SharedStorageConnector", "ExampleConnector",
                              "MooncakeStoreConnector", "LMCacheConnectorV1"})  # fmt: skip
STORE_FAMILIES = ("FlexKV", "HF3FS")


def _is_store(name: Any) -> bool:
    return isinstance(name, str) and (name in STORE_CONNECTORS or name.startswith(STORE_FAMILIES))


def pd_connector(kv: Any) -> tuple[str, str]:
    """The KV connector and engine id a PD router pairs this worker by.

    A MultiConnector wraps several; the one that moves KV between the prefill and the
    decode is what pairs: its only peer-to-peer child, else its only store child, with
    that child's engine id (the wrapper's when the child names none). A wrapper with no
    such child, or two of a kind, is reported as it is: the router must not guess.
    """
    if kv is None:
        return "", ""
    name = str(getattr(kv, "kv_connector", "") or "")
    engine_id = str(getattr(kv, "engine_id", "") or "")
    extra = getattr(kv, "kv_connector_extra_config", None)
    children = extra.get("connectors") if isinstance(extra, dict) else None
    if name != "MultiConnector" or not isinstance(children, list):
        return name, engine_id
    children = [c for c in children if isinstance(c, dict)]
    peers = [c for c in children if c.get("kv_connector") in PEER_CONNECTORS]
    stores = [c for c in children if _is_store(c.get("kv_connector"))]
    movers = peers or stores
    if len(movers) != 1:
        return name, engine_id
    return str(movers[0]["kv_connector"]), str(movers[0].get("engine_id") or engine_id)


# The modalities this worker decodes (engine/vllm/media_inputs.py); a model's others (video,
# audio) are not advertised, so a router does not send them.
SERVED_MODALITIES = ("image",)


def media_limits(llm: AsyncLLM) -> dict[str, int]:
    """Modality -> items per prompt at most: what the model's processor takes, capped by
    --limit-mm-per-prompt (a modality limited to 0 is not taken), of those served here."""
    model_config = llm.vllm_config.model_config
    mm_config = model_config.multimodal_config
    if not model_config.is_multimodal_model or mm_config is None:
        return {}
    supported = llm.renderer.get_mm_processor().info.get_supported_mm_limits()
    limits = {}
    for modality, most in supported.items():
        if modality not in SERVED_MODALITIES:
            continue
        limit = mm_config.get_limit_per_prompt(modality)
        if most is not None:
            limit = min(limit, most)
        if limit > 0:
            limits[modality] = limit
    return limits


def grammar_start(vllm_config: Any) -> tuple[str, bool | None]:
    """The reasoning parser vLLM's structured-output manager runs ("" none), and whether it
    holds a request's grammar back until that parser has seen the thought's end (a parser
    set and `enable_in_reasoning` off); None when the config does not say."""
    structured = getattr(vllm_config, "structured_outputs_config", None)
    if structured is None or not hasattr(structured, "reasoning_parser"):
        return "", None
    parser = str(structured.reasoning_parser or "")
    return parser, bool(parser) and not getattr(structured, "enable_in_reasoning", False)


def model_facts(llm: AsyncLLM, model_defaults: dict[str, Any], *, media: bool = True) -> ModelFacts:
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
    kv_connector, kv_engine_id = pd_connector(kv)
    parallel = vllm_config.parallel_config
    transfer = getattr(vllm_config, "weight_transfer_config", None)
    reasoning_parser, grammar_after_reasoning = grammar_start(vllm_config)
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
        kv_connector=kv_connector,
        kv_role=str(getattr(kv, "kv_role", "") or ""),
        kv_engine_id=kv_engine_id,
        kv_cache_dtype=str(vllm_config.cache_config.cache_dtype or ""),
        model_dtype=str(model_config.dtype),
        reasoning_parser=reasoning_parser,
        grammar_after_reasoning=grammar_after_reasoning,
        thinking_budget=bool(
            getattr(getattr(vllm_config, "reasoning_config", None), "enabled", False)
        ),
        media_limits=media_limits(llm) if media else {},
        tensor_parallel_size=parallel.tensor_parallel_size,
        pipeline_parallel_size=parallel.pipeline_parallel_size,
        total_kv_blocks=int(vllm_config.cache_config.num_gpu_blocks or 0),
        max_batched_tokens=int(vllm_config.scheduler_config.max_num_batched_tokens or 0),
        max_loras=vllm_config.lora_config.max_loras if vllm_config.lora_config else 0,
        sleep_mode=bool(model_config.enable_sleep_mode),
        weight_transfer_backend=str(getattr(transfer, "backend", "") or ""),
        draft_weight_updates=transfer is not None and draft_model(vllm_config),
        instance_id=str(getattr(vllm_config, "instance_id", "") or ""),
        allowed_media_domains=tuple(model_config.allowed_media_domains or ()),
        allowed_local_media_path=model_config.allowed_local_media_path or "",
    )


def draft_model(vllm_config: Any) -> bool:
    """Whether a speculative draft model runs beside the model (what a draft weight update
    updates)."""
    speculative = getattr(vllm_config, "speculative_config", None)
    return getattr(speculative, "draft_model_config", None) is not None
