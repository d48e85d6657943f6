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
import os
import re
import secrets
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio
from tokenizers import Tokenizer

from vllm_router.core.operations import SPAN_PREFIX
from vllm_router.defaults import WEIGHT_FILE_ROOT_ENV
from vllm_router.proto import vllm_native_pb2 as npb
from vllm_router.proto import vllm_native_pb2_grpc as npb_grpc
from vllm_router.server import ServerConfig

from harness import Harness, read_rest, require, start_harness, wait_until
from native_servers import vllm_rs_path, vllm_rs_server
from otlp_receiver import TraceReceiver, attributes
from real_engine import RL_FLAGS, THINK, require_vllm, start_engine, tiny_model
from rl_trainer import WEIGHTS, tensor_names, trained, write_safetensors
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
    # The file backend reads beneath the models' folder only (both engines' workers).
    root = {WEIGHT_FILE_ROOT_ENV: str(base.parent)}
    vllm_rs = vllm_rs_server(model, RL_FLAGS, log, environment=root)
    async with contextlib.AsyncExitStack() as stack:
        with _environment(root):  # read by our engine's processes as they spawn
            engine, reference = await asyncio.gather(
                start_engine(model, RL_FLAGS),
                stack.enter_async_context(in_thread(vllm_rs)),
            )
        harness = await start_harness(engine, ServerConfig(port=0, shutdown_grace_seconds=5.0))
        stack.push_async_callback(harness.close)
        yield harness, reference, base


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


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


async def _health(channel: grpc.aio.Channel) -> str:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    answer = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
    return health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)


def _chunk(path: Path | str, names: list[str] | None = None) -> npb.UpdateWeightsRequest:
    info: dict[str, object] = {"path": str(path), **({"names": names} if names else {})}
    return npb.UpdateWeightsRequest(update_info_json=json.dumps(info).encode())


async def trainer_session(address: str, base: Path, model: Path) -> list[tuple[str, object]]:
    """A trainer's calls, its mistakes included, and what the worker answered to each."""
    channel, ctl = _control(address)
    seen: list[tuple[str, object]] = []

    async def step(name: str, call: object) -> None:
        seen.append((name, await _step(call)))

    async def version(name: str) -> None:
        answer = await ctl.GetWeightVersion(npb.GetWeightVersionRequest())
        seen.append((name, answer.weight_version))

    start = npb.StartWeightUpdateRequest
    finish = npb.FinishWeightUpdateRequest
    async with channel:
        info = await ctl.GetServerInfo(npb.GetServerInfoRequest())
        seen.append(("capabilities", str(info.rl_capabilities)))
        await version("version at start")
        seen.append(("tokens before", await greedy(channel)))
        await step("update before start", ctl.UpdateWeights(_update(base / WEIGHTS)))
        await step("finish without start", ctl.FinishWeightUpdate(finish()))
        bad = npb.InitWeightTransferEngineRequest(init_info_json=b"{")
        await step("init, malformed JSON", ctl.InitWeightTransferEngine(bad))
        listed = npb.UpdateWeightsRequest(update_info_json=b"[{}]")
        await step("update, not an object", ctl.UpdateWeights(listed))
        await step("finish, blank version", ctl.FinishWeightUpdate(finish(weight_version=" ")))
        draft = npb.StartDraftWeightUpdateRequest()
        await step("draft without a draft model", ctl.StartDraftWeightUpdate(draft))
        outside = npb.InitWeightTransferEngineRequest(init_info_json=b'{"root_dir": "/etc"}')
        await step("init, a root outside the worker's", ctl.InitWeightTransferEngine(outside))
        init = npb.InitWeightTransferEngineRequest(init_info_json=b"{}")
        await step("init", ctl.InitWeightTransferEngine(init))
        await step("start", ctl.StartWeightUpdate(start()))
        await step("start again", ctl.StartWeightUpdate(start()))
        await step("init during the update", ctl.InitWeightTransferEngine(init))
        await step("update: base weights", ctl.UpdateWeights(_update(base / WEIGHTS)))
        # A trainer that retries a chunk (its call timed out, say): taken once.
        await step("update: base weights again", ctl.UpdateWeights(_update(base / WEIGHTS)))
        await step("finish as 'base'", ctl.FinishWeightUpdate(finish(weight_version="base")))
        await version("version after")
        seen.append(("tokens on base weights", await greedy(channel)))
        # A backend that refuses (no such file): the update ends, nothing was loaded.
        await step("start", ctl.StartWeightUpdate(start()))
        missing = _update(model / "missing.safetensors")
        await step("update: a missing file", ctl.UpdateWeights(missing))
        seen.append(("health after the refusal", await _health(channel)))
        await step("finish after it", ctl.FinishWeightUpdate(finish()))
        await step("start", ctl.StartWeightUpdate(start()))
        await step("finish, nothing sent", ctl.FinishWeightUpdate(finish()))
        seen.append(("tokens after the refusal", await greedy(channel)))
        # A chunk of the wrong shape: refused before anything is loaded.
        await step("start", ctl.StartWeightUpdate(start()))
        await step("update: a wrong shape", ctl.UpdateWeights(_chunk(_wrong_shape(model))))
        seen.append(("health after the wrong shape", await _health(channel)))
        seen.append(("tokens after the wrong shape", await greedy(channel)))
        # A file outside the worker's root: refused before vLLM here (the update stays
        # open); vllm-rs passes it on, and the same backend refuses it in vLLM's worker.
        await step("start", ctl.StartWeightUpdate(start()))
        await step("update: outside the root", ctl.UpdateWeights(_update("/etc/hostname")))
        await step("finish, nothing loaded", ctl.FinishWeightUpdate(finish()))
        # The trainer's weights back, in two chunks (each tensor once in an update).
        await step("start", ctl.StartWeightUpdate(start()))
        first = ["lm_head.weight", "model.embed_tokens.weight"]
        rest = [name for name in tensor_names(model / WEIGHTS) if name not in first]
        for label, chunk in (("head", first), ("the rest", rest)):
            await step(f"update: trainer weights, {label}",
                       ctl.UpdateWeights(_chunk(model / WEIGHTS, chunk)))  # fmt: skip
        await step("finish as 'rl'", ctl.FinishWeightUpdate(finish(weight_version="rl")))
        await version("version at end")
        seen.append(("tokens at end", await greedy(channel)))
    return seen


def _wrong_shape(model: Path) -> Path:
    """A safetensors file beneath the root whose one tensor has the right name and the
    wrong shape."""
    target = model.parent / "wrong-shape.safetensors"
    write_safetensors(target, {"model.norm.weight": ("BF16", [3], b"\0" * 6)})
    return target


# What a worker that holds the sequence itself answers where vllm-rs passes the call on to
# vLLM's workers (which refuse it with INTERNAL, or take it): (ours, vllm-rs's).
_NO_UPDATE = "FAILED_PRECONDITION: {}: no weight update is open; send StartWeightUpdate first"
_OPEN = (
    "FAILED_PRECONDITION: {}: a weight update is open (started, not finished); send "
    "FinishWeightUpdate first"
)
_OUTSIDE = "update_info.path '/etc/hostname' is outside the weight-file root"
DIFFERENCES: dict[str, tuple[str, str]] = {
    "update before start": (
        _NO_UPDATE.format("UpdateWeights"),
        "INTERNAL: update_weights failed: Call to collective_rpc method failed: Worker failed "
        "with error 'start_weight_update must be called before update_weights.', please "
        "check the stack trace above for the root cause",
    ),
    "finish without start": (
        _NO_UPDATE.format("FinishWeightUpdate"),
        "INTERNAL: finish_weight_update failed: Call to collective_rpc method failed: Worker "
        "failed with error 'finish_weight_update called without a matching "
        "start_weight_update.', please check the stack trace above for the root cause",
    ),
    "init, a root outside the worker's": (
        "PERMISSION_DENIED: init_info.root_dir '/etc' is outside the worker's weight-file root",
        "INTERNAL: init_weight_transfer_engine failed: Call to collective_rpc method failed: "
        "Worker failed with error 'init_info.root_dir '/etc' is outside the worker's "
        "weight-file root', please check the stack trace above for the root cause",
    ),
    "start again": (
        _OPEN.format("StartWeightUpdate"),
        "INTERNAL: start_weight_update failed: Call to collective_rpc method failed: Worker "
        "failed with error 'start_weight_update called while a weight update is already "
        "active. Call finish_weight_update first.', please check the stack trace above for "
        "the root cause",
    ),
    "init during the update": (_OPEN.format("InitWeightTransferEngine"), "OK"),
    "update: outside the root": (
        f"PERMISSION_DENIED: {_OUTSIDE}",
        "INTERNAL: update_weights failed: Call to collective_rpc method failed: Worker failed "
        f"with error '{_OUTSIDE} (nothing was loaded: the served model is as it was)', "
        "please check the stack trace above for the root cause",
    ),
    "finish, nothing loaded": (
        "OK",
        "INTERNAL: finish_weight_update failed: Call to collective_rpc method failed: Worker "
        "failed with error 'finish_weight_update called without a matching "
        "start_weight_update.', please check the stack trace above for the root cause",
    ),
}


async def test_a_trainers_weight_updates_are_answered_as_vllm_rs_answers_them(
    rl_workers: tuple[Harness, str, Path], real: Harness
) -> None:
    """The same trainer session, mistakes included, on our worker and on vllm-rs (the same
    file backend in both engines): the same answers but where this worker holds the
    sequence itself (DIFFERENCES), and the same tokens after every step."""
    harness, reference, base = rl_workers
    model = harness.engine.facts.model_name
    ours = await trainer_session(harness.address, base, Path(model))
    theirs = await trainer_session(reference, base, Path(model))
    differ = {name: (a, b) for (name, a), (_, b) in zip(ours, theirs, strict=True) if a != b}
    # After a refused chunk the worker says why no update is open; vLLM's workers only that.
    refused = str(dict(ours)["update: a missing file"]).removeprefix("INTERNAL: ")
    assert differ.pop("finish after it") == (
        f"FAILED_PRECONDITION: FinishWeightUpdate: no weight update is open: the last one "
        f"failed ({refused}); send StartWeightUpdate and every chunk again",
        DIFFERENCES["finish without start"][1],
    )
    assert differ == DIFFERENCES, "\n".join(
        f"{name}: ours {a!r}, vllm-rs {b!r}" for name, (a, b) in differ.items()
    )
    seen = dict(ours)
    assert seen["version at start"] == "default" and seen["version after"] == "base"
    assert seen["version at end"] == "rl"
    assert seen["update: base weights again"] == "OK"  # a retried chunk, taken once
    assert (
        seen["init, malformed JSON"] == "INVALID_ARGUMENT: init_info_json must contain valid JSON"
    )
    assert str(seen["update: a missing file"]).startswith("INTERNAL: update_weights failed")
    assert "no such file beneath the root" in str(seen["update: a missing file"])
    assert "tensors of the wrong shape" in str(seen["update: a wrong shape"])
    assert "model.norm.weight [3]" in str(seen["update: a wrong shape"])
    # Refused with nothing loaded: the worker served on, on the weights it had.
    assert seen["health after the refusal"] == seen["health after the wrong shape"] == "SERVING"
    assert "the last one failed" in str(seen["finish after it"])
    # The base weights answer as a worker started on them; the trainer's as before.
    on_base = await greedy(real.channel)
    assert seen["tokens on base weights"] == on_base != seen["tokens before"]
    assert seen["tokens after the refusal"] == seen["tokens after the wrong shape"] == on_base
    assert seen["tokens at end"] == seen["tokens before"]
    assert 'weight_transfer_backend: "file"' in str(seen["capabilities"])


async def test_a_load_that_fails_in_finish_is_undone_and_served_again_after_a_whole_update(
    rl_workers: tuple[Harness, str, Path], real: Harness
) -> None:
    """A Finish whose load fails part-way (a tensor the model has not, between two real
    ones): the layers not yet rebuilt are restored, the worker goes NOT_SERVING and refuses
    generation saying why (no forward pass runs on the mixed model), Update and Finish are
    FAILED_PRECONDITION; a new complete update on the same worker brings it back SERVING,
    answering as a worker started on those weights. (On vllm-rs the same backend undoes
    the load too, but vllm-rs serves the mixed model on, and its workers keep the update
    open: its next Start is refused until a Finish closes it.)"""
    harness, reference, base = rl_workers
    model = Path(harness.engine.facts.model_name)
    names = ["model.embed_tokens.weight", "model.layers.0.mlp.bogus.weight", "lm_head.weight"]
    bogus = model.parent / "unknown-tensor.safetensors"
    write_safetensors(bogus, {names[1]: ("BF16", [2], b"\0" * 4)}, copy_from=base / WEIGHTS)
    channel, ctl = _control(harness.address)
    async with channel:
        assert await _health(channel) == "SERVING"
        served = (await ctl.GetWeightVersion(npb.GetWeightVersionRequest())).weight_version
        await ctl.StartWeightUpdate(npb.StartWeightUpdateRequest())
        await ctl.UpdateWeights(_chunk(bogus, names))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await ctl.FinishWeightUpdate(npb.FinishWeightUpdateRequest(weight_version="mixed"))
        assert err.value.code() == grpc.StatusCode.INTERNAL
        assert "bogus" in (err.value.details() or "")
        assert await _health(channel) == "NOT_SERVING"
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await greedy(channel)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "weight update failed part-way" in (err.value.details() or "")
        refused = await _step(ctl.FinishWeightUpdate(npb.FinishWeightUpdateRequest()))
        assert refused.startswith(
            "FAILED_PRECONDITION: FinishWeightUpdate: no weight update is open: the last one "
            "failed (finish_weight_update failed:"
        ) and refused.endswith("send StartWeightUpdate and every chunk again")
        # The failed Finish set no version.
        assert (await ctl.GetWeightVersion(npb.GetWeightVersionRequest())).weight_version == served
        # A whole update: the base weights, then the trainer's back for the module's tests.
        await ctl.StartWeightUpdate(npb.StartWeightUpdateRequest())
        await ctl.UpdateWeights(_update(base / WEIGHTS))
        await ctl.FinishWeightUpdate(npb.FinishWeightUpdateRequest(weight_version="base"))
        assert await _health(channel) == "SERVING"
        assert await greedy(channel) == await greedy(real.channel)
        await ctl.StartWeightUpdate(npb.StartWeightUpdateRequest())
        await ctl.UpdateWeights(_update(model / WEIGHTS))
        await ctl.FinishWeightUpdate(npb.FinishWeightUpdateRequest(weight_version="rl"))
    # vllm-rs, the same sequence: what it does instead (for the record of the difference).
    channel, ctl = _control(reference)
    async with channel:
        await ctl.StartWeightUpdate(npb.StartWeightUpdateRequest())
        await ctl.UpdateWeights(_chunk(bogus, names))
        failed = await _step(ctl.FinishWeightUpdate(npb.FinishWeightUpdateRequest()))
        assert failed.startswith("INTERNAL: finish_weight_update failed") and "bogus" in failed
        assert await _health(channel) == "SERVING"
        again = await _step(ctl.StartWeightUpdate(npb.StartWeightUpdateRequest()))
        assert "already active" in again
        await ctl.FinishWeightUpdate(npb.FinishWeightUpdateRequest())  # closes it
        await ctl.StartWeightUpdate(npb.StartWeightUpdateRequest())
        await ctl.UpdateWeights(_update(model / WEIGHTS))
        await ctl.FinishWeightUpdate(npb.FinishWeightUpdateRequest(weight_version="rl"))


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
