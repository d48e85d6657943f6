"""What GetServerInfo reports to pair prefill and decode workers (pure: no engine)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_router.engine.vllm.facts import pd_connector


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
