"""What GetServerInfo reports to pair prefill and decode workers, and to shape structured
outputs and media for a worker (pure: no engine)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_router.contracts.vllm_grpc_engine import responses
from vllm_router.engine import ModelFacts
from vllm_router.engine.vllm.facts import grammar_start, pd_connector


def kv(connector: str, engine_id: str = "parent", **extra: object) -> SimpleNamespace:
    return SimpleNamespace(kv_connector=connector, engine_id=engine_id,
                           kv_connector_extra_config=extra)  # fmt: skip


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (None, ("", "")),
        (kv("NixlConnector", "e1"), ("NixlConnector", "e1")),
        (kv("SharedStorageConnector"), ("SharedStorageConnector", "parent")),
        # A MultiConnector pairs by the child that moves the KV between the two sides:
        # the one peer-to-peer child, with its own engine id ...
        (kv("MultiConnector", connectors=[
            {"kv_connector": "OffloadingConnector"},
            {"kv_connector": "NixlConnector", "engine_id": "child"},
        ]), ("NixlConnector", "child")),
        # ... or the parent's when it names none; a store only when there is no peer.
        (kv("MultiConnector", connectors=[
            {"kv_connector": "LMCacheConnectorV1"}, {"kv_connector": "MooncakeConnector"},
        ]), ("MooncakeConnector", "parent")),
        (kv("MultiConnector", connectors=[
            {"kv_connector": "OffloadingConnector"}, {"kv_connector": "FlexKVConnectorV1"},
        ]), ("FlexKVConnectorV1", "parent")),
        # Two of a kind, or none: reported as it is, the router must not guess.
        (kv("MultiConnector", connectors=[
            {"kv_connector": "NixlConnector"}, {"kv_connector": "MooncakeConnector"},
        ]), ("MultiConnector", "parent")),
        (kv("MultiConnector", connectors=[{"kv_connector": "OffloadingConnector"}]),
         ("MultiConnector", "parent")),
        (kv("MultiConnector", connectors="not a list"), ("MultiConnector", "parent")),
    ],
)  # fmt: skip
def test_the_connector_a_router_pairs_by(config: object, expected: tuple[str, str]) -> None:
    assert pd_connector(config) == expected


@pytest.mark.parametrize(
    ("structured", "expected", "label"),
    [
        (SimpleNamespace(reasoning_parser="", enable_in_reasoning=False), ("", False),
         "first_token"),
        (SimpleNamespace(reasoning_parser="deepseek_r1", enable_in_reasoning=False),
         ("deepseek_r1", True), "after_reasoning"),
        (SimpleNamespace(reasoning_parser="deepseek_r1", enable_in_reasoning=True),
         ("deepseek_r1", False), "first_token"),
        (SimpleNamespace(), ("", None), ""),  # a config that does not say
        (None, ("", None), ""),
    ],
)  # fmt: skip
def test_where_a_grammar_starts_on_a_thinking_prompt(
    structured: object, expected: tuple[str, bool | None], label: str
) -> None:
    """vLLM's structured-output manager holds a grammar back until its reasoning parser
    has seen the thought's end, unless enable_in_reasoning; the label vLLM's server sends."""
    assert grammar_start(SimpleNamespace(structured_outputs_config=structured)) == expected
    parser, after = expected
    info = responses.server_info(
        _facts(reasoning_parser=parser, grammar_after_reasoning=after), 0, 0.0
    )
    assert (info.engine_reasoning_parser, info.constrained_decoding_start) == (parser, label)


@pytest.mark.parametrize(
    ("model_dtype", "expected"),
    [("torch.bfloat16", "bfloat16"), ("torch.float32", "float32"), ("torch.float8_e4m3fn", ""),
     ("", "")],
)  # fmt: skip
def test_the_encoder_dtype_is_the_models_for_every_model(model_dtype: str, expected: str) -> None:
    text_only = responses.server_info(_facts(model_dtype=model_dtype), 0, 0.0)
    assert text_only.multimodal_encoder_dtype == expected
    vision = responses.server_info(
        _facts(model_dtype=model_dtype, media_limits={"image": 1}), 0, 0.0
    )
    assert vision.multimodal_encoder_dtype == expected


def _facts(**extra: object) -> ModelFacts:
    return ModelFacts(
        model_name="m", served_model_name="m", max_model_len=64, vocab_size=100, dp_size=1,
        block_size=16, eos_token_ids=(2,), engine="test", engine_version="0",
        **extra,  # type: ignore[arg-type]
    )  # fmt: skip
