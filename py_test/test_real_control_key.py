"""The session's real worker has a control key (as a worker behind a router is deployed):
every RPC that changes it, on each contract, refused without the key, and afterwards nothing
changed (the adapters listed, the weight version, the prefix cache's work, the greedy
tokens); with the key the same calls succeed. The matrix of every RPC runs on the mock
(test_control_key.py); this is the same on vLLM."""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc

from vllm_router.proto import vllm_engine_pb2 as pb
from vllm_router.proto import vllm_engine_pb2_grpc as pb_grpc
from vllm_router.proto import vllm_native_pb2 as npb
from vllm_router.proto import vllm_native_pb2_grpc as npb_grpc

from harness import Harness, request
from real_engine import CONTROL_KEY, tiny_lora

pytestmark = pytest.mark.vllm


async def _state(real: Harness, *, generate: bool = True) -> tuple[list[str], str, bool, list[int]]:
    """What a refused call must leave as it was (read with the key; a paused engine is not
    asked to generate: it would hold the request)."""
    ctl = npb_grpc.ControlStub(real.channel)
    adapters = await real.stub.ListLoraAdapters(pb.ListLoraAdaptersRequest())
    version = await ctl.GetWeightVersion(npb.GetWeightVersionRequest())
    paused = await ctl.IsPaused(npb.IsPausedRequest())
    tokens: list[int] = []
    if generate:
        greedy = await real.stub.Generate(request([5, 6, 7], max_tokens=8, temperature=0.0))
        tokens = list(greedy.output_token_ids)
    return sorted(a.name for a in adapters.adapters), version.weight_version, paused.paused, tokens


def _calls(channel: grpc.aio.Channel, key: str | None) -> dict[str, Callable[[], Awaitable[Any]]]:
    """Each control call, made when called (one at a time: a call starts when it is made)."""
    metadata = (("authorization", f"Bearer {key}"),) if key else None
    ours, native = pb_grpc.VllmEngineStub(channel), npb_grpc.ControlStub(channel)
    smg = vpb_grpc.VllmEngineStub(channel)
    adapter = str(tiny_lora())
    return {
        "LoadLoraAdapter": lambda: ours.LoadLoraAdapter(
            pb.LoadLoraAdapterRequest(name="keyed", path=adapter), metadata=metadata
        ),
        "vllm.Control/LoadLora": lambda: native.LoadLora(
            npb.LoadLoraRequest(lora_name="keyed-native", source_path=adapter), metadata=metadata
        ),
        "UpdateWeightVersion": lambda: native.UpdateWeightVersion(
            npb.UpdateWeightVersionRequest(weight_version="stolen"), metadata=metadata
        ),
        "ResetPrefixCache": lambda: ours.ResetPrefixCache(
            pb.ResetPrefixCacheRequest(), metadata=metadata
        ),
        "FlushCache": lambda: smg.FlushCache(common_pb2.FlushCacheRequest(), metadata=metadata),
        # Last: with the key it pauses the engine, which then holds any generation.
        "PauseGeneration": lambda: native.PauseGeneration(
            npb.PauseGenerationRequest(mode=npb.PAUSE_MODE_ABORT), metadata=metadata
        ),
    }


async def test_control_rpcs_need_the_control_key_and_a_refusal_changes_nothing(
    real: Harness,
) -> None:
    before = await _state(real)
    ctl = npb_grpc.ControlStub(real.channel)
    async with grpc.aio.insecure_channel(real.address) as plain:  # no key, as a router
        for key in (None, "wrong-key"):
            for name, call in _calls(plain, key).items():
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call()
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, (name, key)
                assert CONTROL_KEY not in (err.value.details() or "")
        assert await _state(real) == before
        # With the key: each one does what it says (and is undone for the session's tests).
        try:
            for call in _calls(plain, CONTROL_KEY).values():
                await call()
            adapters, version, paused, _ = await _state(real, generate=False)
            assert {"keyed", "keyed-native"} <= set(adapters)
            assert version == "stolen" and paused
        finally:
            await ctl.ResumeGeneration(npb.ResumeGenerationRequest())
            for name in ("keyed", "keyed-native"):
                with contextlib.suppress(grpc.aio.AioRpcError):
                    await ctl.UnloadLora(npb.UnloadLoraRequest(lora_name=name))
            await ctl.UpdateWeightVersion(npb.UpdateWeightVersionRequest(weight_version=before[1]))
    assert await _state(real) == before
