"""vllm.Control's RL half and the native request's reasoning fields, on the mock: statuses and
messages as vllm-rs gives them, the order of the checks, one RL call at a time. The same on
the real engine and against vllm-rs: test_real_weight_transfer.py."""

from __future__ import annotations

import asyncio
import json
import secrets

import grpc
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from test_native import _code, _stream, _stream_error, control, native, stopping

from vllm_router.core.operations import SPAN_PREFIX, EngineOperations
from vllm_router.proto import vllm_native_pb2 as npb
from vllm_router.server import ServerConfig

from harness import Harness, StartServer, delta, scrape

NOT_CONFIGURED = "weight transfer is not configured; start vLLM with --weight-transfer-config"


async def _error(call: object) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call  # type: ignore[misc]
    return err.value.code(), err.value.details() or ""


async def test_weight_transfer_without_a_backend_is_refused_before_its_json(mock: Harness) -> None:
    ctl = control(mock)
    calls = [
        ctl.InitWeightTransferEngine(npb.InitWeightTransferEngineRequest(init_info_json=b"{")),
        ctl.StartWeightUpdate(npb.StartWeightUpdateRequest()),
        ctl.StartDraftWeightUpdate(npb.StartDraftWeightUpdateRequest()),
        ctl.UpdateWeights(npb.UpdateWeightsRequest(update_info_json=b"[]")),
        ctl.FinishWeightUpdate(npb.FinishWeightUpdateRequest(weight_version=" ")),
    ]
    for call in calls:
        assert await _error(call) == (grpc.StatusCode.FAILED_PRECONDITION, NOT_CONFIGURED)
    info = await ctl.GetServerInfo(npb.GetServerInfoRequest())
    assert not info.rl_capabilities.weight_transfer_enabled
    # The version alone needs no backend (as vllm-rs).
    await ctl.UpdateWeightVersion(npb.UpdateWeightVersionRequest(weight_version="v1"))
    assert (await ctl.GetWeightVersion(npb.GetWeightVersionRequest())).weight_version == "v1"


async def test_weight_update_steps_and_their_refusals(start_mock: StartServer) -> None:
    harness = await start_mock(weight_transfer_backend="file")
    ctl = control(harness)
    info = await ctl.GetServerInfo(npb.GetServerInfoRequest())
    assert info.rl_capabilities.weight_transfer_enabled
    assert info.rl_capabilities.weight_transfer_backend == "file"
    assert not info.rl_capabilities.draft_weight_updates_enabled
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    for data in (b"", b"{", b"\xff"):
        code, message = await _error(
            ctl.InitWeightTransferEngine(npb.InitWeightTransferEngineRequest(init_info_json=data))
        )
        assert code == invalid and message.startswith("init_info_json must contain valid JSON")
    for data in (b"[{}]", b"null", b"3"):
        assert await _error(ctl.UpdateWeights(npb.UpdateWeightsRequest(update_info_json=data))) == (
            invalid,
            "update_info_json must contain a JSON object",
        )
    assert await _error(
        ctl.FinishWeightUpdate(npb.FinishWeightUpdateRequest(weight_version=""))
    ) == (invalid, "weight_version must not be empty")
    assert await _error(ctl.StartDraftWeightUpdate(npb.StartDraftWeightUpdateRequest())) == (
        grpc.StatusCode.FAILED_PRECONDITION,
        "draft weight updates require a configured speculative draft model",
    )
    # Out of order: refused by the worker (FAILED_PRECONDITION), the engine never called
    # (vllm-rs passes them to vLLM's workers, which answer INTERNAL).
    assert await _error(ctl.UpdateWeights(npb.UpdateWeightsRequest(update_info_json=b"{}"))) == (
        grpc.StatusCode.FAILED_PRECONDITION,
        "UpdateWeights: no weight update is open; send StartWeightUpdate first",
    )
    assert await _error(ctl.FinishWeightUpdate(npb.FinishWeightUpdateRequest())) == (
        grpc.StatusCode.FAILED_PRECONDITION,
        "FinishWeightUpdate: no weight update is open; send StartWeightUpdate first",
    )

    await ctl.InitWeightTransferEngine(npb.InitWeightTransferEngineRequest(init_info_json=b"{}"))
    await ctl.StartWeightUpdate(npb.StartWeightUpdateRequest())
    open_now = (
        grpc.StatusCode.FAILED_PRECONDITION,
        "{}: a weight update is open (started, not finished); send FinishWeightUpdate first",
    )
    code, message = await _error(ctl.StartWeightUpdate(npb.StartWeightUpdateRequest()))
    assert (code, message) == (open_now[0], open_now[1].format("StartWeightUpdate"))
    init = npb.InitWeightTransferEngineRequest(init_info_json=b"{}")
    code, message = await _error(ctl.InitWeightTransferEngine(init))
    assert (code, message) == (open_now[0], open_now[1].format("InitWeightTransferEngine"))
    assert harness.engine.weight_updates == []  # none of the refused calls reached it
    for chunk in (b'{"path": "a"}', b'{"path": "b"}'):
        await ctl.UpdateWeights(npb.UpdateWeightsRequest(update_info_json=chunk))
    await ctl.FinishWeightUpdate(npb.FinishWeightUpdateRequest(weight_version="step-1"))
    assert harness.engine.weight_updates == [{"path": "a"}, {"path": "b"}]
    assert (await ctl.GetWeightVersion(npb.GetWeightVersionRequest())).weight_version == "step-1"
    # Finished without a version: the version stays.
    await ctl.StartWeightUpdate(npb.StartWeightUpdateRequest())
    await ctl.FinishWeightUpdate(npb.FinishWeightUpdateRequest())
    assert (await ctl.GetWeightVersion(npb.GetWeightVersionRequest())).weight_version == "step-1"


async def test_rl_calls_run_one_at_a_time_in_arrival_order(start_mock: StartServer) -> None:
    """As vllm-rs's one lock: a second update step waits for the first, in order; a bad
    request is refused at once, without waiting."""
    harness = await start_mock(weight_transfer_backend="file")
    ctl = control(harness)
    release, started = asyncio.Event(), asyncio.Event()
    order: list[str] = []
    engine = harness.engine
    update = engine.update_weights

    async def slow_update(update_info: dict) -> None:
        order.append("update starts")
        started.set()
        await release.wait()
        await update(update_info)
        order.append("update ends")

    async def finish(version: str | None) -> None:
        order.append("finish")
        engine._updating = False

    engine.update_weights = slow_update  # type: ignore[method-assign]
    engine.finish_weight_update = finish  # type: ignore[method-assign]
    await ctl.StartWeightUpdate(npb.StartWeightUpdateRequest())
    first = asyncio.ensure_future(
        ctl.UpdateWeights(npb.UpdateWeightsRequest(update_info_json=b'{"path": "a"}'))
    )
    await asyncio.wait_for(started.wait(), 10)
    second = asyncio.ensure_future(ctl.FinishWeightUpdate(npb.FinishWeightUpdateRequest()))
    bad = await _error(ctl.UpdateWeights(npb.UpdateWeightsRequest(update_info_json=b"[")))
    assert bad[0] == grpc.StatusCode.INVALID_ARGUMENT  # not held behind the lock
    await asyncio.sleep(0.2)
    assert order == ["update starts"] and not second.done()
    release.set()
    await asyncio.gather(first, second)
    assert order == ["update starts", "update ends", "finish"]


async def test_thinking_budget_and_reasoning_gate_are_taken(mock: Harness) -> None:
    """As vllm-rs: a budget (-1: none) and a gate are taken; on an engine with no reasoning
    configuration the budget has no effect (the mock has none)."""
    plain = await _stream(mock, native([10], stopping=stopping(3)))
    for budget in (-1, 0, 7):
        req = native([10], stopping=stopping(3, thinking_token_budget=budget))
        assert await _stream(mock, req) == plain
    assert mock.engine.last_request.sampling.thinking_token_budget is None
    gate = npb.ReasoningGate(reasoning_ended=False)
    gate.chat_template_kwargs.update({"enable_thinking": True})
    assert await _stream(mock, native([10], stopping=stopping(3), engine_reasoning_gate=gate))
    last = mock.engine.last_request
    assert last.reasoning_ended is False
    assert last.reasoning_kwargs == {"chat_template_kwargs": {"enable_thinking": True}}


MANY = npb.RandomSampling(num_sequences=2)


@pytest.mark.parametrize(
    ("fault", "code", "words"),
    [
        # What vllm-rs checks before the sequences: told as it is.
        ({"model": "other"}, grpc.StatusCode.NOT_FOUND, "other"),
        ({"prompt": None}, grpc.StatusCode.INVALID_ARGUMENT, "prompt is required"),
        # What it checks after them: the sequences' refusal.
        ({"lora_name": "adapter"}, grpc.StatusCode.INVALID_ARGUMENT, "num_sequences > 1"),
        ({"temperature": 9.0}, grpc.StatusCode.INVALID_ARGUMENT, "num_sequences > 1"),
        ({"ids": [10] * 5000}, grpc.StatusCode.INVALID_ARGUMENT, "num_sequences > 1"),
        ({"media": [npb.MediaItem()]}, grpc.StatusCode.INVALID_ARGUMENT, "num_sequences > 1"),
        ({"watermarking": True}, grpc.StatusCode.INVALID_ARGUMENT, "num_sequences > 1"),
    ],
)
async def test_sequences_are_refused_in_vllm_rs_order(
    mock: Harness, fault: dict, code: grpc.StatusCode, words: str
) -> None:
    """num_sequences > 1 is served (a kept difference) but, wrong twice, a request is told
    what vllm-rs tells it (its sequences after the model and the prompt, before the rest)."""
    fields = dict(fault)
    ids = fields.pop("ids", [10])
    if fields.pop("prompt", 1) is None:
        req = npb.GenerateRequest(sampling=MANY, **fields)
    else:
        req = native(ids, sampling=MANY, stopping=stopping(2), **fields)
    err = await _stream_error(mock, req)
    assert err.code() == code and words in (err.details() or ""), err.details()
    # Alone, each fault is told as itself; the sequences alone are served.
    if words == "num_sequences > 1":
        req.sampling.num_sequences = 1
        alone = await _stream_error(mock, req)
        assert "num_sequences" not in (alone.details() or "")
    served = await _stream(mock, native([10], sampling=MANY, stopping=stopping(2)))
    assert {m.outputs.index for m in served if m.HasField("outputs")} == {0, 1}


async def test_generate_refuses_sequences_first_too(mock: Harness) -> None:
    from test_native import inference

    req = native([10], sampling=MANY, stopping=stopping(2), lora_name="adapter")
    assert await _code(inference(mock).Generate(req)) == grpc.StatusCode.INVALID_ARGUMENT


async def test_rl_operations_are_measured_and_traced(start_mock: StartServer) -> None:
    """Each step of a weight push is one span, a child of the trainer's span, with how it
    ended; and one observation of engine_operation_seconds by operation and code."""
    config = ServerConfig(port=0, shutdown_grace_seconds=2.0, metrics_port=0)
    harness = await start_mock(config, weight_transfer_backend="file")
    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    core = harness.server.core
    core.operations = EngineOperations(core.metrics, provider.get_tracer("test"))
    ctl = control(harness)
    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
    metadata = (("traceparent", f"00-{trace_id}-{parent_id}-01"),)
    before = await scrape(harness.metrics_url)

    await _error(ctl.FinishWeightUpdate(npb.FinishWeightUpdateRequest(), metadata=metadata))
    await ctl.InitWeightTransferEngine(
        npb.InitWeightTransferEngineRequest(init_info_json=b"{}"), metadata=metadata
    )
    await ctl.StartWeightUpdate(npb.StartWeightUpdateRequest(), metadata=metadata)
    for chunk in (b'{"path": "a"}', b'{"path": "b"}'):
        await ctl.UpdateWeights(npb.UpdateWeightsRequest(update_info_json=chunk), metadata=metadata)
    await ctl.FinishWeightUpdate(
        npb.FinishWeightUpdateRequest(weight_version="step-1"), metadata=metadata
    )
    await ctl.PauseGeneration(npb.PauseGenerationRequest())  # no caller's trace: a root span
    await ctl.ResumeGeneration(npb.ResumeGenerationRequest())
    # Refused before the queue: neither measured nor traced as an operation.
    await _error(ctl.UpdateWeights(npb.UpdateWeightsRequest(update_info_json=b"[")))

    finished = spans.get_finished_spans()
    steps = [
        (span.name.removeprefix(SPAN_PREFIX), str((span.attributes or {})["vllm_servicer.status"]))
        for span in finished
    ]
    assert steps == [
        ("finish_weight_update", "FAILED_PRECONDITION"),
        ("init_weight_transfer", "OK"),
        ("start_weight_update", "OK"),
        ("update_weights", "OK"),
        ("update_weights", "OK"),
        ("finish_weight_update", "OK"),
        ("pause", "OK"),
        ("resume", "OK"),
    ]
    for span in finished[:6]:
        assert span.context is not None and span.parent is not None
        assert span.context.trace_id == int(trace_id, 16)
        assert span.parent.span_id == int(parent_id, 16)
    assert finished[0].status.status_code is StatusCode.ERROR
    assert "no weight update is open" in (finished[0].status.description or "")
    assert (finished[5].attributes or {})["vllm_servicer.weight_version"] == "step-1"
    assert finished[6].parent is None
    assert (finished[6].attributes or {})["vllm_servicer.mode"] == "abort"

    after = await scrape(harness.metrics_url)
    seconds = "vllm_servicer:engine_operation_seconds_count"
    counted = {
        (operation, code): delta(before, after, seconds, operation=operation, code=code)
        for operation, code in {step for step in steps} | {("update_weights", "INVALID_ARGUMENT")}
    }
    assert counted == {
        ("finish_weight_update", "FAILED_PRECONDITION"): 1,
        ("init_weight_transfer", "OK"): 1,
        ("start_weight_update", "OK"): 1,
        ("update_weights", "OK"): 2,
        ("finish_weight_update", "OK"): 1,
        ("pause", "OK"): 1,
        ("resume", "OK"): 1,
        ("update_weights", "INVALID_ARGUMENT"): 0,
    }


_QUICK_HEALTH = ServerConfig(port=0, shutdown_grace_seconds=2.0, health_poll_seconds=0.05)


async def _serving(harness: Harness) -> tuple[str, str]:
    """(grpc.health.v1's status, a generation's status code)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    health = health_pb2_grpc.HealthStub(harness.channel)
    status = (await health.Check(health_pb2.HealthCheckRequest())).status
    try:
        await _stream(harness, native([5, 6], stopping=stopping(2)))
        generated = "OK"
    except grpc.aio.AioRpcError as err:
        generated = err.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(status), generated


async def test_a_failed_update_leaves_the_worker_as_the_model_it_left(
    start_mock: StartServer,
) -> None:
    """A chunk refused with nothing loaded: the update is over, the worker serves on. One
    that left the model part-loaded: NOT_SERVING and generation UNAVAILABLE, saying why,
    until a new complete update; Update and Finish meanwhile are FAILED_PRECONDITION."""
    harness = await start_mock(_QUICK_HEALTH, weight_transfer_backend="file")
    ctl = control(harness)

    def chunk(**info: str) -> npb.UpdateWeightsRequest:
        return npb.UpdateWeightsRequest(update_info_json=json.dumps(info).encode())

    assert await _serving(harness) == ("SERVING", "OK")
    await ctl.StartWeightUpdate(npb.StartWeightUpdateRequest())
    code, message = await _error(ctl.UpdateWeights(chunk(path="a", mock_failure="refused")))
    assert code == grpc.StatusCode.INTERNAL and "refused" in message
    assert await _serving(harness) == ("SERVING", "OK")
    code, message = await _error(ctl.FinishWeightUpdate(npb.FinishWeightUpdateRequest()))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert "the last one failed" in message and "refused" in message

    await ctl.StartWeightUpdate(npb.StartWeightUpdateRequest())
    await ctl.UpdateWeights(chunk(path="a"))
    code, _ = await _error(ctl.UpdateWeights(chunk(path="b", mock_failure="part-loaded")))
    assert code == grpc.StatusCode.INTERNAL
    assert await _serving(harness) == ("NOT_SERVING", "UNAVAILABLE")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _stream(harness, native([5, 6], stopping=stopping(2)))
    assert "weight update failed part-way" in (err.value.details() or "")
    for call in (
        ctl.UpdateWeights(chunk(path="b")),
        ctl.FinishWeightUpdate(npb.FinishWeightUpdateRequest(weight_version="never")),
    ):
        assert (await _error(call))[0] == grpc.StatusCode.FAILED_PRECONDITION
    # A new update that fails too keeps it out of rotation; a complete one brings it back.
    await ctl.StartWeightUpdate(npb.StartWeightUpdateRequest())
    await _error(ctl.UpdateWeights(chunk(path="c", mock_failure="refused")))
    assert await _serving(harness) == ("NOT_SERVING", "UNAVAILABLE")
    await ctl.StartWeightUpdate(npb.StartWeightUpdateRequest())
    await ctl.UpdateWeights(chunk(path="all"))
    await ctl.FinishWeightUpdate(npb.FinishWeightUpdateRequest(weight_version="whole"))
    assert await _serving(harness) == ("SERVING", "OK")
    assert (await ctl.GetWeightVersion(npb.GetWeightVersionRequest())).weight_version == "whole"
    assert harness.engine.weight_updates == [{"path": "a"}, {"path": "all"}]


async def test_a_model_the_engine_cannot_restore_makes_the_worker_exit(
    start_mock: StartServer,
) -> None:
    """A part-loaded model the engine cannot undo (vLLM's own backends): NOT_SERVING at
    once, then the worker drains and exits non-zero for a restart, as for an engine death."""
    harness = await start_mock(_QUICK_HEALTH, weight_transfer_backend="file")
    ctl = control(harness)
    await ctl.StartWeightUpdate(npb.StartWeightUpdateRequest())
    info = json.dumps({"path": "a", "mock_failure": "lost"}).encode()
    code, _ = await _error(ctl.UpdateWeights(npb.UpdateWeightsRequest(update_info_json=info)))
    assert code == grpc.StatusCode.INTERNAL
    assert (await _serving(harness))[1] == "UNAVAILABLE"
    assert await asyncio.wait_for(harness.server.run_until_shutdown(), 10) == 1
