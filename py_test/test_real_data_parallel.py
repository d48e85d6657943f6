"""One worker, two data-parallel engine cores (vLLM's in-process DP, `--data-parallel-size 2`)
on vLLM-CPU: each rank reports its own load from its own scheduler, a request pinned to a
rank runs there (seen from the engine's per-rank figures), both contracts; prefix-cache
events from every rank reach a subscriber with the rank they came from; the SMG router with
`--dp-aware` spreads requests over both ranks and answers as in front of vLLM's own
`--grpc` server with the same DP flags; vllm-router spreads requests over both ranks through
vLLM's native contract and, kv_aware, follows the ranks' own KV-event publishers."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc

from vllm_router.proto import vllm_engine_pb2 as pb
from vllm_router.server import ServerConfig

import native_servers
import real_engine
import routers
from harness import Harness, real_engine_idle, request, require, start_harness, wait_until
from vllm_servers import free_port

pytestmark = pytest.mark.vllm

DP = 2


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def dp_reference(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[routers.Launch]:
    """vLLM's own --grpc server with two data-parallel ranks, launched before `dp2` starts
    (their start-ups overlap)."""
    real_engine.require_vllm()
    model = real_engine.tiny_model()
    flags = {**real_engine.BASE_FLAGS, "data_parallel_size": DP}
    log = tmp_path_factory.mktemp("dp-reference") / "vllm-grpc-dp.log"
    async with routers.launched(grpc=routers.vllm_grpc_server(model, flags, log)) as launches:
        yield launches["grpc"]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def dp2(dp_reference: routers.Launch) -> AsyncIterator[Harness]:
    real_engine.require_vllm()
    model = real_engine.tiny_model()
    kv_events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{free_port(run=DP)}",  # rank r publishes on port + r
    }
    flags = {**real_engine.BASE_FLAGS, "data_parallel_size": DP, "kv_events_config": kv_events}
    engine = await real_engine.start_engine(model, flags)
    harness = await start_harness(engine, ServerConfig(port=0, shutdown_grace_seconds=5.0), model)
    try:
        yield harness
    finally:
        await harness.close()


async def _running_by_rank(harness: Harness) -> list[int]:
    loads = await harness.stub.GetLoads(pb.GetLoadsRequest())
    return [r.running_requests for r in loads.ranks]


@pytest.mark.parametrize("target", [0, 1])
async def test_a_pinned_request_runs_on_its_rank_and_each_rank_reports_itself(
    dp2: Harness, target: int
) -> None:
    await wait_until(lambda: real_engine_idle(dp2), 20.0, "idle before pinning")
    loads = await dp2.stub.GetLoads(pb.GetLoadsRequest())
    assert [r.dp_rank for r in loads.ranks] == [0, 1]
    assert all(r.HasField("measured_at") for r in loads.ranks)  # both engine cores reported
    streams = []
    for i in range(4):
        pinned = request([5 + i, 6, 7], max_tokens=240, ignore_eos=True)
        pinned.dp_rank = target
        streams.append(dp2.stub.GenerateStream(pinned))
    for stream in streams:
        await stream.read()
    seen: list[int] = []
    for _ in range(200):  # the ranks' schedulers report at their next step
        seen = await _running_by_rank(dp2)
        if seen[target] >= 1:
            break
        await asyncio.sleep(0.01)
    other = 1 - target
    assert seen[target] >= 1 and seen[other] == 0, seen
    official = vpb_grpc.VllmEngineStub(dp2.channel)
    theirs = await official.GetLoads(vpb.GetLoadsRequest())
    by_rank = {load.dp_rank: load.num_running_reqs for load in theirs.loads}
    assert theirs.dp_rank_count == DP and by_rank[other] == 0, by_rank
    for stream in streams:
        stream.cancel()
    await wait_until(lambda: real_engine_idle(dp2), 20.0, "the cancelled streams aborted")


async def test_a_rank_out_of_range_is_invalid_on_both_contracts(dp2: Harness) -> None:
    bad = request([5, 6], max_tokens=2)
    bad.dp_rank = DP
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await dp2.stub.Generate(bad)
    assert (
        err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "dp_size 2" in err.value.details()
    )
    official = vpb_grpc.VllmEngineStub(dp2.channel)
    theirs = vpb.GenerateRequest(
        tokenized=vpb.TokenizedInput(input_ids=[5, 6]),
        sampling_params=vpb.SamplingParams(max_tokens=2),
        data_parallel_rank=DP,
    )
    with pytest.raises(grpc.aio.AioRpcError) as err:
        [r async for r in official.Generate(theirs)]
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "data_parallel_rank 2" in err.value.details()


async def test_prefix_cache_events_from_every_rank_carry_their_rank(dp2: Harness) -> None:
    block = dp2.engine.facts.block_size
    stub = vpb_grpc.VllmEngineStub(dp2.channel)
    events = stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest())
    await asyncio.sleep(0.5)  # a ZMQ subscriber sees only what is published after it joins
    for rank in range(DP):
        prompt = [(i * 7 + rank * 3) % 400 + 5 for i in range(block + 3)]
        pinned = request(prompt, temperature=0.0, max_tokens=2)
        pinned.dp_rank = rank
        await dp2.stub.Generate(pinned)
    stored_on: set[int] = set()

    async def until_both() -> None:
        async for batch in events:
            if any(e.WhichOneof("data") == "stored" for e in batch.events):
                assert batch.HasField("dp_rank")
                stored_on.add(batch.dp_rank)
            if stored_on == set(range(DP)):
                return

    await asyncio.wait_for(until_both(), 30)
    events.cancel()
    assert stored_on == {0, 1}


def _successes_by_engine(harness: Harness) -> dict[str, float]:
    """vLLM's own per-engine-core count of finished requests (`engine` label)."""
    registry = harness.engine.prometheus_registry()
    counts: dict[str, float] = {}
    for family in registry.collect():
        for sample in family.samples:
            if sample.name == "vllm:request_success_total":
                engine = sample.labels.get("engine", "?")
                counts[engine] = counts.get(engine, 0.0) + sample.value
    return counts


async def test_the_dp_aware_router_spreads_over_both_ranks_with_vllms_answers(
    dp2: Harness, dp_reference: routers.Launch, tmp_path: Path, figures: Any
) -> None:
    require(routers.smg_path() is not None, "smg is not installed (make test)")
    model = real_engine.tiny_model()
    bodies = [
        {"model": str(model), **routers.chat(f"Question {i}", max_tokens=12, temperature=0)}
        for i in range(16)
    ]
    before = _successes_by_engine(dp2)
    async with routers.smg_router_in_thread(
        [dp2.address], model, tmp_path / "router-dp-ours.log", "--dp-aware"
    ) as ours_base:
        ours = await asyncio.gather(
            *(routers.ask(ours_base, routers.CHAT, body, False) for body in bodies)
        )
    after = _successes_by_engine(dp2)
    moved = {engine: after.get(engine, 0.0) - before.get(engine, 0.0) for engine in after}
    assert all(answer[0] == 200 for answer in ours), ours
    assert sum(moved.values()) >= len(bodies)
    assert all(moved.get(str(rank), 0.0) >= 1 for rank in range(DP)), moved  # both ranks
    worker = await dp_reference.ready()
    async with routers.in_thread(
        routers.smg_router([worker], model, tmp_path / "router-dp-ref.log", "--dp-aware")
    ) as base:
        theirs = [await routers.ask(base, routers.CHAT, body, False) for body in bodies]
    assert ours == theirs
    figures(f"--dp-aware router, 16 chats: finished per engine core {moved}; = vLLM --grpc DP=2")


def _moved(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {engine: after.get(engine, 0.0) - before.get(engine, 0.0) for engine in after}


async def test_vllm_router_spreads_over_both_ranks(
    dp2: Harness, tmp_path: Path, figures: Any
) -> None:
    """vllm-router with --intra-node-data-parallel-size 2 pins each request to a rank through
    the `x-data-parallel-rank` metadata of vLLM's native contract: both ranks serve."""
    require(native_servers.vllm_router_path() is not None, "vllm-router is not installed")
    model = real_engine.tiny_model()
    bodies = [
        {"model": str(model), **routers.chat(f"Question {i}", max_tokens=12, temperature=0)}
        for i in range(16)
    ]
    before = _successes_by_engine(dp2)
    async with native_servers.vllm_router_in_thread(
        [dp2.address], model, tmp_path / "vllm-router-dp.log",
        "--intra-node-data-parallel-size", str(DP),
    ) as base:  # fmt: skip
        together = await asyncio.gather(
            *(routers.ask(base, routers.CHAT, body, False) for body in bodies)
        )
        alone = [await routers.ask(base, routers.CHAT, body, False) for body in bodies]
    moved = _moved(before, _successes_by_engine(dp2))
    assert all(answer[0] == 200 for answer in together) and together == alone
    assert sum(moved.values()) >= 2 * len(bodies)
    assert all(moved.get(str(rank), 0.0) >= 1 for rank in range(DP)), moved
    figures(f"vllm-router over DP=2, 32 chats: finished per engine core {moved}")


async def test_vllm_router_kv_aware_follows_our_kv_event_sources(
    dp2: Harness, tmp_path: Path, figures: Any
) -> None:
    """`--policy kv_aware`: the router subscribes to the publishers GetKvEventSources names
    (one per rank) and sends a prompt whose prefix one rank has cached to that rank. Each
    rank in turn is given a prefix first (pinned through our contract): a router that did
    not hear the ranks' events could not follow both."""
    require(native_servers.vllm_router_path() is not None, "vllm-router is not installed")
    model = real_engine.tiny_model()
    block = dp2.engine.facts.block_size
    placed: dict[int, list[str]] = {}
    async with native_servers.vllm_router_in_thread(
        [dp2.address], model, tmp_path / "vllm-router-kv.log", "--policy", "kv_aware",
        "--intra-node-data-parallel-size", str(DP),
    ) as base:  # fmt: skip
        await asyncio.sleep(1.0)  # the router's subscribers join before the first events
        for target in range(DP):
            prefix = [(i * 11 + target * 5) % 300 + 5 for i in range(block)]  # one whole block
            warm = request([*prefix, 399], temperature=0.0, max_tokens=1)
            warm.dp_rank = target
            await dp2.stub.Generate(warm)
            await asyncio.sleep(0.5)  # the stored block's event reaches the router
            for suffix in range(3):
                body = {"model": str(model), "prompt": [*prefix, 400 + suffix], "max_tokens": 2,
                        "temperature": 0}  # fmt: skip
                before = _successes_by_engine(dp2)
                status, _, _ = await routers.ask(base, routers.COMPLETIONS, body, False)
                assert status == 200
                moved = _moved(before, _successes_by_engine(dp2))
                placed.setdefault(target, []).append(max(moved, key=lambda e: moved[e]))
    assert placed == {rank: [str(rank)] * 3 for rank in range(DP)}, placed
    figures(f"kv_aware over DP=2: prefixes cached on rank 0 / rank 1 followed to {placed}")
