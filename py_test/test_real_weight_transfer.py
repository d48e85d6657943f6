"""An RL trainer driving a rollout worker over vLLM's native contract, on the real engine: weight
updates through the file backend (engine/vllm/file_weights.py, registered by this package's
`vllm.general_plugins` entry point, so vLLM's own workers find it) and thinking budgets, each
sent to this worker and to vllm-rs (same checkpoint, same engine flags, the same plugin
loaded in its vLLM engine), which must give the same statuses and the same tokens.

The workers start on the trainer's moved weights (rl_trainer.py) and are given the tiny
model's own weights back: after that update they answer as the session's `real` worker,
started on those weights, does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import secrets
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio
from tokenizers import Tokenizer

from vllm_router.core.operations import SPAN_PREFIX
from vllm_router.proto import vllm_native_pb2 as npb
from vllm_router.proto import vllm_native_pb2_grpc as npb_grpc
from vllm_router.server import ServerConfig

from harness import Harness, read_rest, require, start_harness, wait_until
from native_servers import vllm_rs_path, vllm_rs_server
from otlp_receiver import TraceReceiver, attributes
from real_engine import RL_FLAGS, THINK, require_vllm, start_engine, tiny_model
from rl_trainer import WEIGHTS, trained
from routers import in_thread

pytestmark = pytest.mark.vllm

PROMPT = [5, 6, 7, 8, 9, 10]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def rl_workers() -> AsyncIterator[tuple[Harness, str, Path]]:
    """(our worker, vllm-rs's gRPC address, the tiny model), both on the trainer's weights
    with RL_FLAGS; started side by side."""
    require_vllm()
    require(vllm_rs_path() is not None, "vllm-rs is not installed (make test)")
    base = await asyncio.to_thread(tiny_model)
    model = await asyncio.to_thread(trained, base, base.parent / "tiny-llama-rl")
    log = model.parent / "vllm-rs-rl.log"
    async with contextlib.AsyncExitStack() as stack:
        engine, reference = await asyncio.gather(
            start_engine(model, RL_FLAGS),
            stack.enter_async_context(in_thread(vllm_rs_server(model, RL_FLAGS, log))),
        )
        harness = await start_harness(engine, ServerConfig(port=0, shutdown_grace_seconds=5.0))
        stack.push_async_callback(harness.close)
        yield harness, reference, base


def _control(address: str) -> tuple[grpc.aio.Channel, npb_grpc.ControlStub]:
    channel = grpc.aio.insecure_channel(address)
    return channel, npb_grpc.ControlStub(channel)


class _WithMetadata(grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """Sends `metadata` on every call of the channel (a trainer's trace context)."""

    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self._metadata = metadata

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        details = details._replace(metadata=(*(details.metadata or ()), *self._metadata))
        return await continuation(details, request)


def _traced_control(
    address: str, metadata: tuple[tuple[str, str], ...]
) -> tuple[grpc.aio.Channel, npb_grpc.ControlStub]:
    channel = grpc.aio.insecure_channel(address, interceptors=[_WithMetadata(metadata)])
    return channel, npb_grpc.ControlStub(channel)


async def greedy(
    channel: grpc.aio.Channel,
    prompt: list[int] = PROMPT,
    budget: int | None = None,
    max_new: int = 12,
) -> list[int]:
    stopping = npb.StoppingCriteria(max_new_tokens=max_new, ignore_eos=True)
    if budget is not None:
        stopping.thinking_token_budget = budget
    request = npb.GenerateRequest(
        token_ids=npb.TokenIds(ids=prompt),
        temperature=0.0,
        stopping=stopping,
        response=npb.ResponseOptions(output_token_ids=True, output_text=False),
    )
    answer = await npb_grpc.InferenceStub(channel).Generate(request)
    return list(answer.outputs.token_ids)


# vllm-rs names its engine-core call ("utility call `collective_rpc` failed (call_id=7): ")
# and JSON parsers word their errors their own way: neither is the answer.
_CALL_ID = re.compile(r"utility call `\w+` failed \(call_id=\d+\): ")


def _said(message: str) -> str:
    message = _CALL_ID.sub("", message)
    return message.split(": ")[0] if "valid JSON" in message else message


async def _step(call: object) -> str:
    try:
        await call  # type: ignore[misc]
    except grpc.aio.AioRpcError as err:
        return f"{err.code().name}: {_said(err.details() or '')}"
    return "OK"


def _update(path: Path | str) -> npb.UpdateWeightsRequest:
    return npb.UpdateWeightsRequest(update_info_json=json.dumps({"path": str(path)}).encode())


async def trainer_session(address: str, base: Path, model: Path) -> list[tuple[str, object]]:
    """A trainer's calls, its mistakes included, and what the worker answered to each."""
    channel, ctl = _control(address)
    seen: list[tuple[str, object]] = []

    async def step(name: str, call: object) -> None:
        seen.append((name, await _step(call)))

    async def version(name: str) -> None:
        answer = await ctl.GetWeightVersion(npb.GetWeightVersionRequest())
        seen.append((name, answer.weight_version))

    async with channel:
        info = await ctl.GetServerInfo(npb.GetServerInfoRequest())
        seen.append(("capabilities", str(info.rl_capabilities)))
        await version("version at start")
        seen.append(("tokens before", await greedy(channel)))
        await step("update before start", ctl.UpdateWeights(_update(base / WEIGHTS)))
        await step("finish without start", ctl.FinishWeightUpdate(npb.FinishWeightUpdateRequest()))
        bad = npb.InitWeightTransferEngineRequest(init_info_json=b"{")
        await step("init, malformed JSON", ctl.InitWeightTransferEngine(bad))
        listed = npb.UpdateWeightsRequest(update_info_json=b"[{}]")
        await step("update, not an object", ctl.UpdateWeights(listed))
        blank = npb.FinishWeightUpdateRequest(weight_version=" ")
        await step("finish, blank version", ctl.FinishWeightUpdate(blank))
        draft = npb.StartDraftWeightUpdateRequest()
        await step("draft without a draft model", ctl.StartDraftWeightUpdate(draft))
        init = npb.InitWeightTransferEngineRequest(init_info_json=b"{}")
        await step("init", ctl.InitWeightTransferEngine(init))
        await step("start", ctl.StartWeightUpdate(npb.StartWeightUpdateRequest()))
        await step("start again", ctl.StartWeightUpdate(npb.StartWeightUpdateRequest()))
        await step("update: base weights", ctl.UpdateWeights(_update(base / WEIGHTS)))
        finish = npb.FinishWeightUpdateRequest(weight_version="base")
        await step("finish as 'base'", ctl.FinishWeightUpdate(finish))
        await version("version after")
        seen.append(("tokens on base weights", await greedy(channel)))
        # A backend that refuses (no such file): vLLM ends the update; start + finish with
        # nothing sent restores the weights the model had.
        await step("start", ctl.StartWeightUpdate(npb.StartWeightUpdateRequest()))
        missing = _update(model / "missing.safetensors")
        await step("update: a missing file", ctl.UpdateWeights(missing))
        await step("finish after it", ctl.FinishWeightUpdate(npb.FinishWeightUpdateRequest()))
        await step("start", ctl.StartWeightUpdate(npb.StartWeightUpdateRequest()))
        await step("finish, nothing sent", ctl.FinishWeightUpdate(npb.FinishWeightUpdateRequest()))
        seen.append(("tokens after the refusal", await greedy(channel)))
        # The trainer's weights back, in two chunks of whole layers.
        await step("start", ctl.StartWeightUpdate(npb.StartWeightUpdateRequest()))
        for chunk in (["lm_head.weight", "model.embed_tokens.weight"], None):
            info_json = {"path": str(model / WEIGHTS), **({"names": chunk} if chunk else {})}
            update = npb.UpdateWeightsRequest(update_info_json=json.dumps(info_json).encode())
            await step(f"update: trainer weights {chunk or 'all'}", ctl.UpdateWeights(update))
        await step("finish as 'rl'", ctl.FinishWeightUpdate(npb.FinishWeightUpdateRequest(
            weight_version="rl")))  # fmt: skip
        await version("version at end")
        seen.append(("tokens at end", await greedy(channel)))
    return seen


async def test_a_trainers_weight_updates_are_answered_as_vllm_rs_answers_them(
    rl_workers: tuple[Harness, str, Path], real: Harness
) -> None:
    harness, reference, base = rl_workers
    model = harness.engine.facts.model_name
    ours = await trainer_session(harness.address, base, Path(model))
    theirs = await trainer_session(reference, base, Path(model))
    assert ours == theirs, "\n".join(
        f"{name}: ours {a!r}, vllm-rs {b!r}"
        for (name, a), (_, b) in zip(ours, theirs, strict=True)
        if a != b
    )
    seen = dict(ours)
    assert seen["version at start"] == "default" and seen["version after"] == "base"
    assert seen["version at end"] == "rl"
    assert str(seen["start again"]).startswith("INTERNAL: start_weight_update failed")
    assert (
        seen["init, malformed JSON"] == "INVALID_ARGUMENT: init_info_json must contain valid JSON"
    )
    assert seen["update before start"] == (
        "INTERNAL: update_weights failed: Call to collective_rpc method failed: Worker failed "
        "with error 'start_weight_update must be called before update_weights.', please "
        "check the stack trace above for the root cause"
    )
    # The base weights answer as a worker started on them; the trainer's as before.
    on_base = await greedy(real.channel)
    assert seen["tokens on base weights"] == on_base != seen["tokens before"]
    assert seen["tokens after the refusal"] == on_base
    assert seen["tokens at end"] == seen["tokens before"]
    assert 'weight_transfer_backend: "file"' in str(seen["capabilities"])


async def test_a_request_kept_by_a_pause_runs_on_after_an_update(
    rl_workers: tuple[Harness, str, Path], real: Harness, otlp: TraceReceiver
) -> None:
    """PauseGeneration(KEEP) across an update, as vLLM's own server does it: the request in
    flight is frozen, one sent meanwhile waits, both finish whole on resume; the one sent
    during the pause runs wholly on the new weights. (vllm-rs asks vLLM 0.33's engine for
    `pause_generation`, which this vLLM 0.32 engine has not: it answers INTERNAL "…
    'EngineCoreProc' object has no attribute 'pause_generation'", so not compared here.) Each step
    of the trainer's is a span in the trainer's trace, exported over OTLP (the session's
    `real` worker set the process's exporter up)."""
    harness, _, base = rl_workers
    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
    traced = (("traceparent", f"00-{trace_id}-{parent_id}-01"),)
    channel, ctl = _traced_control(harness.address, traced)
    inference = npb_grpc.InferenceStub(channel)
    long = npb.GenerateRequest(
        token_ids=npb.TokenIds(ids=[11, 12, 13]),
        temperature=0.0,
        stopping=npb.StoppingCriteria(max_new_tokens=120, ignore_eos=True),
        response=npb.ResponseOptions(output_token_ids=True, output_text=False),
    )
    async with channel:
        stream = inference.GenerateStream(long)
        first = await stream.read()  # the prompt's facts
        assert first.HasField("prompt_info")
        await ctl.PauseGeneration(npb.PauseGenerationRequest(mode=npb.PAUSE_MODE_KEEP))
        assert (await ctl.IsPaused(npb.IsPausedRequest())).paused
        waiting = asyncio.ensure_future(greedy(channel))
        await ctl.StartWeightUpdate(npb.StartWeightUpdateRequest())
        await ctl.UpdateWeights(_update(base / WEIGHTS))
        await ctl.FinishWeightUpdate(npb.FinishWeightUpdateRequest(weight_version="paused"))
        await asyncio.sleep(0.5)
        assert not waiting.done()
        await ctl.ResumeGeneration(npb.ResumeGenerationRequest())
        rest = await read_rest(stream)
        tokens = [t for m in rest for t in m.outputs.token_ids]
        assert len(tokens) == 120 and rest[-1].outputs.finish_info.finish_reason == npb.LENGTH
        assert await waiting == await greedy(real.channel)
        # The trainer's weights back, for the module's other tests.
        model = Path(harness.engine.facts.model_name)
        await ctl.StartWeightUpdate(npb.StartWeightUpdateRequest())
        await ctl.UpdateWeights(_update(model / WEIGHTS))
        await ctl.FinishWeightUpdate(npb.FinishWeightUpdateRequest(weight_version="rl"))
    await wait_until(lambda: harness.server.requests.in_flight == frozenset())

    def operations() -> list[Any]:  # the trainer's generate calls have vLLM's spans too
        found = [span for _, span in otlp.spans_of_trace(trace_id)]
        return [span for span in found if span.name.startswith(SPAN_PREFIX)]

    await wait_until(lambda: len(operations()) == 8, timeout=15, what="8 operation spans")
    spans = operations()
    spans.sort(key=lambda span: span.start_time_unix_nano)
    assert [span.name.removeprefix(SPAN_PREFIX) for span in spans] == [
        "pause", *["start_weight_update", "update_weights", "finish_weight_update"], "resume",
        *["start_weight_update", "update_weights", "finish_weight_update"],
    ]  # fmt: skip
    assert all(span.parent_span_id == bytes.fromhex(parent_id) for span in spans)
    assert attributes(spans[0])["vllm_servicer.mode"] == "keep"
    assert attributes(spans[3])["vllm_servicer.weight_version"] == "paused"
    assert {attributes(span)["vllm_servicer.status"] for span in spans} == {"OK"}


async def test_thinking_budgets_end_thinking_as_vllm_rs_ends_it(
    rl_workers: tuple[Harness, str, Path],
) -> None:
    """On an engine with a reasoning configuration the budget closes the thinking (the end
    marker's tokens forced after it), token for token as through vllm-rs."""
    harness, reference, base = rl_workers
    tokenizer = Tokenizer.from_file(str(base / "tokenizer.json"))
    start, end = (tokenizer.encode(mark, add_special_tokens=False).ids for mark in THINK)
    thinking = [5, 6, 7, *start]  # a prompt that ends inside the model's thinking
    ours, theirs = {}, {}
    async with grpc.aio.insecure_channel(reference) as channel:
        for budget in (None, -1, 0, 2, 5):
            ours[budget] = await greedy(harness.channel, thinking, budget, max_new=24)
            theirs[budget] = await greedy(channel, thinking, budget, max_new=24)
    assert ours == theirs
    closed = {budget: _where(tokens, end) for budget, tokens in ours.items()}
    # At once with no budget left, later with more; never without one.
    assert closed[0] == 0 < closed[2] < closed[5], closed
    assert closed[None] == closed[-1] == -1 and ours[None] == ours[-1]


def _where(tokens: list[int], part: list[int]) -> int:
    """Where `part` first appears in `tokens` (-1: nowhere)."""
    for i in range(len(tokens) - len(part) + 1):
        if tokens[i : i + len(part)] == part:
            return i
    return -1
