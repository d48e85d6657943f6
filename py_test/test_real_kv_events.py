"""SubscribeKvEvents on the real engine: vLLM's prefix-cache events reach the subscriber."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc

from vllm_router.proto import vllm_engine_pb2 as pb

from harness import Harness, real_engine_idle, request, wait_until
from real_engine import MAX_MODEL_LEN

pytestmark = pytest.mark.vllm


async def test_prefix_cache_events_are_relayed(real: Harness) -> None:
    await wait_until(lambda: real_engine_idle(real), 10.0, "the engine to be idle")
    assert (await real.stub.ResetPrefixCache(pb.ResetPrefixCacheRequest())).success
    block = real.engine.facts.block_size
    full = max(1, (MAX_MODEL_LEN - 8) // block)  # full blocks that fit the context
    prompt = [(i * 11) % 400 + 7 for i in range(full * block + 5)]
    stub = vpb_grpc.VllmEngineStub(real.channel)
    events = stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest())
    await asyncio.sleep(0.5)  # a ZMQ subscriber sees only what is published after it joins
    await real.stub.Generate(request(prompt, temperature=0.0, max_tokens=2))
    stored: list[common_pb2.KvBlock] = []
    ids: list[int] = []

    async def until_prompt_blocks() -> None:
        async for batch in events:
            for event in batch.events:
                ids.append(event.event_id)
                if event.WhichOneof("data") == "stored":
                    stored.extend(event.stored.blocks)
            if len(stored) >= full:
                return

    await asyncio.wait_for(until_prompt_blocks(), 20)
    assert [list(b.token_ids) for b in stored[:full]] == [
        prompt[i * block : (i + 1) * block] for i in range(full)
    ]
    assert all(b.block_size == block for b in stored) and all(b.block_hash for b in stored)
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    assert (await real.stub.ResetPrefixCache(pb.ResetPrefixCacheRequest())).success
    # vLLM publishes what happened to its cache at its next scheduler step.
    await real.stub.Generate(request([5, 6], max_tokens=1))

    async def until_cleared() -> None:
        async for batch in events:
            if any(e.WhichOneof("data") == "cleared" for e in batch.events):
                return

    await asyncio.wait_for(until_cleared(), 20)
    events.cancel()
    info = await stub.GetServerInfo(vpb.GetServerInfoRequest())
    assert info.server_type == "vllm-grpc"
    with pytest.raises(grpc.aio.AioRpcError) as err:  # no --profiler-config on this engine
        await stub.StartProfile(common_pb2.StartProfileRequest())
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "--profiler-config" in err.value.details()
