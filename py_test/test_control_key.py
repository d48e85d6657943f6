"""The control key (--control-api-key) and --no-admin-rpcs, on the mock: every RPC of every
contract is classified (control or router); every control RPC needs the control key, and a
refused one never reaches its handler (it changes nothing); router RPCs need only what they
needed before; empty keys never start a server; the open-control warning; the client.

Control RPCs are called generically, from the service descriptors, so an RPC added to a
contract is covered here the day it is added."""

from __future__ import annotations

import logging
import os
import subprocess
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from google.protobuf import descriptor_pool, message_factory
from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc

from vllm_router.client import AuthenticationError, WorkerClient
from vllm_router.client.cli import parser as client_parser
from vllm_router.defaults import API_KEY_ENV, CONTROL_API_KEY_ENV
from vllm_router.proto import vllm_engine_pb2 as pb
from vllm_router.proto import vllm_engine_pb2_grpc as pb_grpc
from vllm_router.proto import vllm_native_pb2 as npb
from vllm_router.proto import vllm_native_pb2_grpc as npb_grpc
from vllm_router.server import ServerConfig, StartupError, preflight
from vllm_router.server.app import warn_if_control_is_open
from vllm_router.server.registry import CONTRACTS, control_methods
from vllm_router.testing.mock_engine import MockAsyncEngine

import servers
from harness import StartServer, collect_stream, delta, request, scrape, start_harness

# Distinct, searchable keys: no refusal message may contain any of them.
CONTROL_KEY = "ctl-7f3a-only-for-tests"
API_KEY = "api-91bc-only-for-tests"
WRONG_KEY = "wrong-5e0d-only-for-tests"
KEYS = (CONTROL_KEY, API_KEY, WRONG_KEY)
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED
PERMISSION_DENIED = grpc.StatusCode.PERMISSION_DENIED
REFUSED = {UNAUTHENTICATED, PERMISSION_DENIED}

# The classification, pinned: which RPCs change the worker (or read its control state) is a
# security decision, so moving one from this list is a change this test must be told of.
EXPECTED_CONTROL_RPCS = {
    "vllm.Control": {
        "LoadLora", "UnloadLora", "ListLoras", "Shutdown", "PauseGeneration",
        "ResumeGeneration", "IsPaused", "Sleep", "WakeUp", "IsSleeping",
        "InitWeightTransferEngine", "StartWeightUpdate", "StartDraftWeightUpdate",
        "UpdateWeights", "FinishWeightUpdate", "UpdateWeightVersion", "GetWeightVersion",
    },
    "vllm.Inference": set(),
    "vllm.engine.v1.VllmEngine": {
        "ResetPrefixCache", "LoadLoraAdapter", "UnloadLoraAdapter", "ListLoraAdapters",
    },
    "vllm.grpc.engine.VllmEngine": {"FlushCache", "StartProfile", "StopProfile"},
}  # fmt: skip


def _service(name: str) -> ServiceDescriptor:
    return descriptor_pool.Default().FindServiceByName(name)


def _rpcs(kind: str) -> tuple[tuple[str, MethodDescriptor], ...]:
    """(service, method) of every registered contract's `kind` ("control_rpcs" or
    "router_rpcs"), in descriptor order."""
    return tuple(
        (entry.service_name, method)
        for entry in CONTRACTS
        for method in _service(entry.service_name).methods
        if method.name in getattr(entry.servicer, kind)
    )


CONTROL_RPCS = _rpcs("control_rpcs")
ROUTER_RPCS = _rpcs("router_rpcs")


def _name(service: str, method: MethodDescriptor) -> str:
    return f"{service}/{method.name}"


def bearer(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


def config(**settings: Any) -> ServerConfig:
    return ServerConfig(port=0, shutdown_grace_seconds=2.0, **settings)


@dataclass(frozen=True)
class Answer:
    """How a call ended: its status, its message and what it answered (in order)."""

    code: grpc.StatusCode
    details: str
    responses: tuple[Message, ...] = ()


async def call(
    channel: grpc.aio.Channel,
    service: str,
    method: MethodDescriptor,
    metadata: tuple[tuple[str, str], ...] | None = None,
    payload: bytes | None = None,
) -> Answer:
    """Call `service`/`method` with `payload` (default: the empty message of its input type),
    whatever its streaming shape; a client-streaming call sends no message."""
    out = message_factory.GetMessageClass(method.output_type)
    body = payload
    if body is None:
        body = message_factory.GetMessageClass(method.input_type)().SerializeToString()
    path = f"/{service}/{method.name}"
    kinds = (method.client_streaming, method.server_streaming)
    responses: list[Message] = []
    try:
        if kinds == (False, False):
            unary = channel.unary_unary(path, response_deserializer=out.FromString)
            responses.append(await unary(body, metadata=metadata, timeout=10))
        elif kinds == (False, True):
            streamed = channel.unary_stream(path, response_deserializer=out.FromString)
            responses += [m async for m in streamed(body, metadata=metadata, timeout=10)]
        else:
            both = channel.stream_stream(path, response_deserializer=out.FromString)
            responses += [m async for m in both(iter(()), metadata=metadata, timeout=10)]
    except grpc.aio.AioRpcError as err:
        return Answer(err.code(), err.details() or "")
    return Answer(grpc.StatusCode.OK, "", tuple(responses))


def assert_keyless(details: str) -> None:
    for key in KEYS:
        assert key not in details, details


# -- every RPC classified -----------------------------------------------------------------


@pytest.mark.parametrize("entry", CONTRACTS, ids=lambda entry: entry.service_name)
def test_every_rpc_of_every_contract_is_classified_once(entry: Any) -> None:
    """control_rpcs and router_rpcs split the service's methods exactly: a new RPC cannot be
    left out (it would be open to any caller holding the API key), none named twice, no
    name that is no method (a typo would guard nothing)."""
    methods = {method.name for method in _service(entry.service_name).methods}
    control, router = entry.servicer.control_rpcs, entry.servicer.router_rpcs
    assert isinstance(control, frozenset) and isinstance(router, frozenset)
    assert not control & router, control & router
    assert control | router == methods, {
        "unclassified": methods - (control | router),
        "not methods": (control | router) - methods,
    }
    assert control == EXPECTED_CONTROL_RPCS[entry.service_name]


def test_control_methods_are_the_full_names_of_every_control_rpc() -> None:
    assert {entry.service_name for entry in CONTRACTS} == set(EXPECTED_CONTROL_RPCS)
    expected = {
        f"/{service}/{name}" for service, names in EXPECTED_CONTROL_RPCS.items() for name in names
    }
    assert control_methods(CONTRACTS) == expected
    assert {f"/{_name(service, method)}" for service, method in CONTROL_RPCS} == expected
    assert len(CONTROL_RPCS) == 24
    # One turned off is no longer guarded (nor served): the native contract's 17 go.
    without_native = tuple(e for e in CONTRACTS if e.service_name != "vllm.Control")
    assert len(control_methods(without_native)) == 7


# -- the matrix: every control RPC, every credential ----------------------------------------


@pytest.mark.parametrize("api_key", [None, API_KEY], ids=["control-key", "control-and-api-keys"])
async def test_every_control_rpc_needs_the_control_key(
    start_mock: StartServer, api_key: str | None, caplog: pytest.LogCaptureFixture
) -> None:
    """Without the control key every control RPC is refused before its handler: no key or a
    wrong one UNAUTHENTICATED, the API key PERMISSION_DENIED, each message naming the RPC and
    what to send, never a key. With it, the call gets exactly the answer a server without
    keys gives (same code, message and response, calls made in the same order), so the
    refused calls made before it changed nothing either."""
    keyed = await start_mock(
        config(api_key=api_key, control_api_key=CONTROL_KEY), weight_transfer_backend="file"
    )
    plain = await start_mock(config(), weight_transfer_backend="file")
    api_refusal = PERMISSION_DENIED if api_key else UNAUTHENTICATED
    refusals = [
        (None, UNAUTHENTICATED),
        (bearer(WRONG_KEY), UNAUTHENTICATED),
        (bearer(API_KEY), api_refusal),
        ((("authorization", CONTROL_KEY),), UNAUTHENTICATED),  # the key, but no "Bearer "
        (bearer(CONTROL_KEY + "x"), UNAUTHENTICATED),
        (bearer(CONTROL_KEY[:-1]), UNAUTHENTICATED),
    ]
    served: dict[str, str] = {}
    caplog.set_level(logging.DEBUG)
    for service, method in CONTROL_RPCS:
        name = _name(service, method)
        for metadata, code in refusals:
            answer = await call(keyed.channel, service, method, metadata)
            assert answer.code == code, (name, metadata, answer)
            assert name in answer.details, answer.details
            assert_keyless(answer.details)
            if code == PERMISSION_DENIED:
                assert "needs the control key" in answer.details
                assert "not the API key" in answer.details
            else:
                assert "'authorization: Bearer <control api key>'" in answer.details
        expected = await call(plain.channel, service, method)
        assert expected.code not in REFUSED, (name, expected)
        assert await call(keyed.channel, service, method, bearer(CONTROL_KEY)) == expected, name
        served[method.name] = expected.code.name
    # The handlers were reached: their own answers, not the interceptor's.
    assert served["GetWeightVersion"] == served["IsPaused"] == "OK"
    assert served["Shutdown"] == "FAILED_PRECONDITION"
    assert served["StartProfile"] == "UNIMPLEMENTED"  # the mock has no profiler
    assert keyed.engine.weight_updates == plain.engine.weight_updates
    assert await keyed.engine.is_paused() == await plain.engine.is_paused()
    for record in caplog.records:  # whatever was logged meanwhile (ours, grpc's): no key
        assert_keyless(record.getMessage())


async def test_with_only_an_api_key_control_rpcs_need_the_api_key(
    start_mock: StartServer,
) -> None:
    """No control key: a control RPC needs what every RPC needs (the API key), as before."""
    keyed = await start_mock(config(api_key=API_KEY), weight_transfer_backend="file")
    plain = await start_mock(config(), weight_transfer_backend="file")
    for service, method in CONTROL_RPCS:
        for metadata in (None, bearer(WRONG_KEY), bearer(CONTROL_KEY)):
            answer = await call(keyed.channel, service, method, metadata)
            assert answer.code == UNAUTHENTICATED, (_name(service, method), answer)
            assert "Bearer <api key>" in answer.details
            assert_keyless(answer.details)
        expected = await call(plain.channel, service, method)
        assert await call(keyed.channel, service, method, bearer(API_KEY)) == expected


# -- a refused call changes nothing ----------------------------------------------------------


async def test_a_refused_call_changes_nothing(start_mock: StartServer) -> None:
    """The weight version, a pause (that would abort a stream in flight), a weight update
    (opened, loaded, finished): refused without the control key, the worker is as it was and
    generation goes on; with the key the same calls take effect."""
    harness = await start_mock(
        config(control_api_key=CONTROL_KEY), weight_transfer_backend="file", step_delay=0.005
    )
    ctl = npb_grpc.ControlStub(harness.channel)
    inference = npb_grpc.InferenceStub(harness.channel)
    key = bearer(CONTROL_KEY)
    engine: MockAsyncEngine = harness.engine

    async def refused(pending: Any) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await pending
        assert err.value.code() == UNAUTHENTICATED, err.value
        assert "vllm.Control/" in (err.value.details() or "")

    def generation(n: int) -> npb.GenerateRequest:
        return npb.GenerateRequest(
            token_ids=npb.TokenIds(ids=[10]),
            stopping=npb.StoppingCriteria(max_new_tokens=n),
            response=npb.ResponseOptions(output_token_ids=True),
        )

    # The weight version: neither set nor read without the key.
    for metadata in (None, bearer(WRONG_KEY)):
        evil = npb.UpdateWeightVersionRequest(weight_version="evil")
        await refused(ctl.UpdateWeightVersion(evil, metadata=metadata))
        await refused(ctl.GetWeightVersion(npb.GetWeightVersionRequest(), metadata=metadata))
    version = await ctl.GetWeightVersion(npb.GetWeightVersionRequest(), metadata=key)
    assert version.weight_version == "default"

    # A pause that would abort the stream in flight: refused, the stream runs to its end.
    stream = inference.GenerateStream(generation(40))
    first = await stream.read()
    assert first is not grpc.aio.EOF and first.HasField("prompt_info")
    abort = npb.PauseGenerationRequest(mode=npb.PAUSE_MODE_ABORT)
    await refused(ctl.PauseGeneration(abort))
    await refused(ctl.PauseGeneration(abort, metadata=bearer(WRONG_KEY)))
    rest = []
    while (message := await stream.read()) is not grpc.aio.EOF:
        rest.append(message)
    assert [t for m in rest for t in m.outputs.token_ids] == list(range(11, 51))
    assert rest[-1].outputs.finish_info.finish_reason == npb.LENGTH
    assert not (await ctl.IsPaused(npb.IsPausedRequest(), metadata=key)).paused
    answer = await inference.Generate(generation(3))  # a router RPC: no key needed
    assert list(answer.outputs.token_ids) == [11, 12, 13]

    # A weight update: none opened, none loaded.
    await refused(ctl.InitWeightTransferEngine(npb.InitWeightTransferEngineRequest()))
    await refused(ctl.StartWeightUpdate(npb.StartWeightUpdateRequest()))
    chunk = npb.UpdateWeightsRequest(update_info_json=b'{"path": "evil"}')
    await refused(ctl.UpdateWeights(chunk))
    assert engine.weights.updating is False and engine.weight_updates == []
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await ctl.FinishWeightUpdate(npb.FinishWeightUpdateRequest(), metadata=key)
    assert (err.value.code(), err.value.details()) == (
        grpc.StatusCode.FAILED_PRECONDITION,
        "FinishWeightUpdate: no weight update is open; send StartWeightUpdate first",
    )

    # With the key, the same calls change the worker...
    v1 = npb.UpdateWeightVersionRequest(weight_version="v1")
    await ctl.UpdateWeightVersion(v1, metadata=key)
    version = await ctl.GetWeightVersion(npb.GetWeightVersionRequest(), metadata=key)
    assert version.weight_version == "v1"
    await ctl.PauseGeneration(abort, metadata=key)
    assert (await ctl.IsPaused(npb.IsPausedRequest(), metadata=key)).paused
    # ...and, paused, a refused resume leaves it paused.
    await refused(ctl.ResumeGeneration(npb.ResumeGenerationRequest()))
    assert await engine.is_paused()
    await ctl.ResumeGeneration(npb.ResumeGenerationRequest(), metadata=key)
    assert not (await ctl.IsPaused(npb.IsPausedRequest(), metadata=key)).paused
    await ctl.StartWeightUpdate(npb.StartWeightUpdateRequest(), metadata=key)
    assert engine.weights.updating is True
    # An open update: a refused chunk or finish neither loads nor closes it.
    await refused(ctl.UpdateWeights(chunk))
    await refused(ctl.FinishWeightUpdate(npb.FinishWeightUpdateRequest(weight_version="evil")))
    assert engine.weights.updating is True and engine.weight_updates == []
    good = npb.UpdateWeightsRequest(update_info_json=b'{"path": "a"}')
    await ctl.UpdateWeights(good, metadata=key)
    step = npb.FinishWeightUpdateRequest(weight_version="step-1")
    await ctl.FinishWeightUpdate(step, metadata=key)
    assert engine.weights.updating is False and engine.weight_updates == [{"path": "a"}]
    version = await ctl.GetWeightVersion(npb.GetWeightVersionRequest(), metadata=key)
    assert version.weight_version == "step-1"
    answer = await inference.Generate(generation(2))
    assert list(answer.outputs.token_ids) == [11, 12]


# -- router RPCs -------------------------------------------------------------------------------


async def _generations(channel: grpc.aio.Channel, metadata: Any) -> dict[str, list[int]]:
    """Token ids generated for prompt [10], two tokens, on each generation RPC of the three
    contracts."""
    ours = pb_grpc.VllmEngineStub(channel)
    smg = vpb_grpc.VllmEngineStub(channel)
    native = npb_grpc.InferenceStub(channel)
    ask = request([10], max_tokens=2)

    def smg_request(stream: bool) -> vpb.GenerateRequest:
        return vpb.GenerateRequest(
            tokenized=vpb.TokenizedInput(input_ids=[10]),
            sampling_params=vpb.SamplingParams(max_tokens=2),
            stream=stream,
        )

    native_request = npb.GenerateRequest(
        token_ids=npb.TokenIds(ids=[10]),
        stopping=npb.StoppingCriteria(max_new_tokens=2),
        response=npb.ResponseOptions(output_token_ids=True),
    )
    streamed = await collect_stream(ours, ask, metadata=metadata)
    smg_streamed = [m async for m in smg.Generate(smg_request(True), metadata=metadata)]
    smg_unary = [m async for m in smg.Generate(smg_request(False), metadata=metadata)]
    native_streamed = [m async for m in native.GenerateStream(native_request, metadata=metadata)]
    native_unary = await native.Generate(native_request, metadata=metadata)
    return {
        "vllm.engine.v1 Generate": list(
            (await ours.Generate(ask, metadata=metadata)).output_token_ids
        ),
        "vllm.engine.v1 GenerateStream": [t for m in streamed for t in m.token_ids],
        "vllm.grpc.engine Generate stream": [t for m in smg_streamed for t in m.chunk.token_ids],
        "vllm.grpc.engine Generate": [t for m in smg_unary for t in m.complete.output_ids],
        "vllm.Inference GenerateStream": [t for m in native_streamed for t in m.outputs.token_ids],
        "vllm.Inference Generate": list(native_unary.outputs.token_ids),
    }


async def _router_calls_work(channel: grpc.aio.Channel, metadata: Any) -> None:
    generated = await _generations(channel, metadata)
    assert generated == {name: [11, 12] for name in generated}
    ours = pb_grpc.VllmEngineStub(channel)
    assert (await ours.GetModelInfo(pb.GetModelInfoRequest(), metadata=metadata)).engine == "mock"
    aborted = await ours.Abort(pb.AbortRequest(request_ids=["x"]), metadata=metadata)
    assert list(aborted.aborted_request_ids) == []
    smg = vpb_grpc.VllmEngineStub(channel)
    info = await smg.GetServerInfo(vpb.GetServerInfoRequest(), metadata=metadata)
    assert info.active_requests == 0
    native = npb_grpc.ControlStub(channel)
    model = await native.GetModelInfo(npb.GetModelInfoRequest(), metadata=metadata)
    assert model.served_model_name == "mock-model"
    assert (await native.GetServerInfo(npb.GetServerInfoRequest(), metadata=metadata)).instance_id
    await native.Abort(npb.AbortRequest(request_ids=["x"]), metadata=metadata)


async def _health(channel: grpc.aio.Channel) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return (await stub.Check(health_pb2.HealthCheckRequest())).status


async def test_router_rpcs_need_no_key_when_only_a_control_key_is_set(
    start_mock: StartServer,
) -> None:
    """Generation, info, Abort on the three contracts and health: open to every caller, the
    credential ignored; and every router RPC answers as on a server without keys."""
    keyed = await start_mock(config(control_api_key=CONTROL_KEY))
    plain = await start_mock(config())
    for metadata in (None, bearer(WRONG_KEY), bearer(API_KEY), bearer(CONTROL_KEY)):
        await _router_calls_work(keyed.channel, metadata)
        for service, method in ROUTER_RPCS:
            answer = await call(keyed.channel, service, method, metadata)
            expected = await call(plain.channel, service, method)
            assert answer.code == expected.code, (_name(service, method), metadata, answer)
            assert answer.code not in REFUSED
    assert await _health(keyed.channel) == health_pb2.HealthCheckResponse.SERVING


async def test_router_rpcs_take_either_key_when_both_are_set(start_mock: StartServer) -> None:
    """An API key and a control key: router RPCs take either (the control key passes the
    API-key check), refuse no key and a wrong one; health needs none."""
    keyed = await start_mock(config(api_key=API_KEY, control_api_key=CONTROL_KEY))
    plain = await start_mock(config())
    for key in (API_KEY, CONTROL_KEY):
        await _router_calls_work(keyed.channel, bearer(key))
    for service, method in ROUTER_RPCS:
        expected = await call(plain.channel, service, method)
        for key in (API_KEY, CONTROL_KEY):
            answer = await call(keyed.channel, service, method, bearer(key))
            assert answer.code == expected.code, (_name(service, method), key, answer)
        for metadata in (None, bearer(WRONG_KEY)):
            answer = await call(keyed.channel, service, method, metadata)
            assert answer.code == UNAUTHENTICATED, (_name(service, method), answer)
            assert "Bearer <api key>" in answer.details
            assert_keyless(answer.details)
    assert await _health(keyed.channel) == health_pb2.HealthCheckResponse.SERVING


# -- --no-admin-rpcs ------------------------------------------------------------------------


async def _listed_services(channel: grpc.aio.Channel, metadata: Any) -> set[str]:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    ask = reflection_pb2.ServerReflectionRequest(list_services="")
    answers = [a async for a in stub.ServerReflectionInfo(iter([ask]), metadata=metadata)]
    return {s.name for a in answers for s in a.list_services_response.service}


@pytest.mark.parametrize(
    "keys",
    [{}, {"control_api_key": CONTROL_KEY}, {"api_key": API_KEY, "control_api_key": CONTROL_KEY}],
    ids=["no-keys", "control-key", "both-keys"],
)
async def test_no_admin_rpcs_refuses_every_control_rpc_whatever_the_key(
    start_mock: StartServer, keys: dict[str, str]
) -> None:
    harness = await start_mock(config(admin_rpcs=False, **keys), weight_transfer_backend="file")
    for service, method in CONTROL_RPCS:
        name = _name(service, method)
        for metadata in (None, bearer(WRONG_KEY), bearer(API_KEY), bearer(CONTROL_KEY)):
            answer = await call(harness.channel, service, method, metadata)
            assert answer.code == grpc.StatusCode.UNIMPLEMENTED, (name, metadata, answer)
            assert name in answer.details and "--no-admin-rpcs" in answer.details
            assert_keyless(answer.details)
    # Never reached: the version a trainer would set, the pause that would hold generation.
    ctl = npb_grpc.ControlStub(harness.channel)
    for request_, rpc in (
        (npb.UpdateWeightVersionRequest(weight_version="evil"), ctl.UpdateWeightVersion),
        (npb.PauseGenerationRequest(mode=npb.PAUSE_MODE_KEEP), ctl.PauseGeneration),
        (npb.StartWeightUpdateRequest(), ctl.StartWeightUpdate),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await rpc(request_, metadata=bearer(CONTROL_KEY))
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    engine: MockAsyncEngine = harness.engine
    assert await engine.weight_version() == "default"
    assert not await engine.is_paused() and engine.weights.updating is False
    # Router RPCs, health and reflection as ever (with the key they need, if any).
    router_key = bearer(API_KEY) if "api_key" in keys else None
    await _router_calls_work(harness.channel, router_key)
    assert await _health(harness.channel) == health_pb2.HealthCheckResponse.SERVING
    assert set(EXPECTED_CONTROL_RPCS) <= await _listed_services(harness.channel, router_key)


# -- start-up: empty keys, the open-control warning --------------------------------------------


def _start_cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    environment = {
        k: v for k, v in os.environ.items() if k not in (API_KEY_ENV, CONTROL_API_KEY_ENV)
    }
    command = servers.command("--mock-engine", "--port", "0", *args, without_vllm=True)
    try:
        return subprocess.run(
            command, capture_output=True, text=True, timeout=30, env={**environment, **env}
        )
    except subprocess.TimeoutExpired as exc:  # it started, and served until killed
        pytest.fail(f"{args} {env} started a worker: {exc.stderr!r}")


@pytest.mark.parametrize(
    ("args", "env", "words"),
    [
        ((), {CONTROL_API_KEY_ENV: ""}, "the control API key must not be empty"),
        (("--control-api-key", ""), {}, "the control API key must not be empty"),
        ((), {API_KEY_ENV: ""}, "the API key must not be empty"),
        (("--api-key", "x"), {CONTROL_API_KEY_ENV: ""}, "the control API key must not be empty"),
    ],
    ids=["control-env", "control-flag", "api-env", "api-flag-and-control-env"],
)
def test_an_empty_key_is_a_one_line_startup_error(
    args: tuple[str, ...], env: dict[str, str], words: str
) -> None:
    """A key variable that is set but empty (a Secret that did not arrive) must never start
    a worker without that key."""
    result = _start_cli(*args, env=env)
    assert result.returncode == 1, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], result.stderr
    assert "Traceback" not in result.stderr and "ready on" not in result.stderr


@pytest.mark.parametrize("setting", ["api_key", "control_api_key"])
async def test_an_empty_key_never_starts_in_process(setting: str) -> None:
    """The in-process start (which skips preflight) refuses it too."""
    bad = config(**{setting: ""})
    with pytest.raises(StartupError, match="must not be empty"):
        preflight(bad)
    with pytest.raises(StartupError, match="must not be empty"):
        harness = await start_harness(MockAsyncEngine(), bad)
        await harness.close()


@pytest.mark.parametrize(
    ("keys", "words"),
    [
        ({"control_api_key": "ctl\n"}, "whitespace or a control character"),
        ({"api_key": "api key"}, "whitespace or a control character"),
        ({"control_api_key": "same", "api_key": "same"}, "must differ from the API key"),
    ],
)
def test_a_key_no_client_could_send_or_that_guards_nothing_is_refused_at_start(
    keys: dict[str, str], words: str
) -> None:
    """A Secret file with a trailing newline would start a worker whose guarded RPCs no
    gRPC client can reach (a header value holds no newline); a control key that is the API
    key, which every client holds, guards nothing more."""
    with pytest.raises(StartupError, match=words) as err:
        preflight(config(**keys))
    assert "\n" not in str(err.value) and all(key not in str(err.value) for key in keys.values())


def test_server_flags_and_variables_set_the_control_settings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """--control-api-key or its variable, --no-admin-rpcs; the keys never in a repr (a
    logged configuration)."""
    from vllm_router.cli import build_parser
    from vllm_router.dataclass_flags import from_args

    monkeypatch.delenv(API_KEY_ENV, raising=False)
    monkeypatch.delenv(CONTROL_API_KEY_ENV, raising=False)
    default = from_args(ServerConfig, build_parser(with_vllm=False).parse_args([]))
    assert (default.control_api_key, default.admin_rpcs) == (None, True)
    flagged = build_parser(with_vllm=False).parse_args(
        ["--control-api-key", CONTROL_KEY, "--no-admin-rpcs"]
    )
    settings = from_args(ServerConfig, flagged)
    assert (settings.control_api_key, settings.admin_rpcs) == (CONTROL_KEY, False)
    monkeypatch.setenv(CONTROL_API_KEY_ENV, CONTROL_KEY)
    monkeypatch.setenv(API_KEY_ENV, API_KEY)
    from_env = from_args(ServerConfig, build_parser(with_vllm=False).parse_args([]))
    assert (from_env.control_api_key, from_env.api_key) == (CONTROL_KEY, API_KEY)
    assert_keyless(repr(from_env))
    # The flag wins over the variable.
    flag = build_parser(with_vllm=False).parse_args(["--control-api-key", "other"])
    assert from_args(ServerConfig, flag).control_api_key == "other"


def _warnings(caplog: pytest.LogCaptureFixture, settings: ServerConfig) -> list[str]:
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="vllm_router.server.app"):
        warn_if_control_is_open(settings)
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_control_rpcs_served_openly_on_a_reachable_address_are_warned_of(
    caplog: pytest.LogCaptureFixture,
) -> None:
    (message,) = _warnings(caplog, ServerConfig(host="0.0.0.0", port=50051))
    assert "0.0.0.0:50051" in message and "without a control key" in message
    assert "--control-api-key" in message and CONTROL_API_KEY_ENV in message
    assert "--no-admin-rpcs" in message and "anyone who reaches the port" in message
    with_api = ServerConfig(host="0.0.0.0", port=50051, api_key=API_KEY)
    (message,) = _warnings(caplog, with_api)
    assert "only the API key" in message and API_KEY not in message
    (message,) = _warnings(caplog, ServerConfig(host="worker-3.example", port=9))
    assert "worker-3.example:9" in message  # a name may resolve to anything
    (message,) = _warnings(caplog, ServerConfig(host="::", port=9))
    assert "[::]:9" in message


@pytest.mark.parametrize(
    "settings",
    [
        ServerConfig(host="127.0.0.1", port=50051),
        ServerConfig(host="localhost", port=50051),
        ServerConfig(host="::1", port=50051),
        ServerConfig(host="0.0.0.0", port=-1, uds="/tmp/x.sock"),
        ServerConfig(host="0.0.0.0", port=50051, control_api_key=CONTROL_KEY),
        ServerConfig(host="0.0.0.0", port=50051, api_key=API_KEY, control_api_key=CONTROL_KEY),
        ServerConfig(host="0.0.0.0", port=50051, admin_rpcs=False),
    ],
    ids=[
        "loopback",
        "localhost",
        "ipv6-loopback",
        "uds-only",
        "control-key",
        "both-keys",
        "no-admin-rpcs",
    ],
)
def test_no_warning_where_control_is_guarded_or_local(
    caplog: pytest.LogCaptureFixture, settings: ServerConfig
) -> None:
    assert _warnings(caplog, settings) == []


# -- the client -----------------------------------------------------------------------------


async def test_client_sends_the_control_key_where_it_is_needed(start_mock: StartServer) -> None:
    only_control = await start_mock(config(control_api_key=CONTROL_KEY))
    async with WorkerClient(only_control.address, control_api_key=CONTROL_KEY) as worker:
        assert await worker.reset_prefix_cache() is True
        reply = await worker.generate([10], max_tokens=2)
        assert list(reply.output_token_ids) == [11, 12]
    async with WorkerClient(only_control.address) as worker:
        assert await worker.health()  # grpc.health.v1: never a key
        assert list((await worker.generate([10], max_tokens=2)).output_token_ids) == [11, 12]
        with pytest.raises(AuthenticationError) as err:
            await worker.reset_prefix_cache()
        assert err.value.code == UNAUTHENTICATED

    both = await start_mock(config(api_key=API_KEY, control_api_key=CONTROL_KEY))
    # The control key alone goes with every call: it passes the API-key check too.
    async with WorkerClient(both.address, control_api_key=CONTROL_KEY) as worker:
        assert await worker.reset_prefix_cache() is True
        assert list((await worker.generate([10], max_tokens=2)).output_token_ids) == [11, 12]
        assert (await worker.model_info()).engine == "mock"
    async with WorkerClient(both.address, api_key=API_KEY) as worker:
        assert list((await worker.generate([10], max_tokens=2)).output_token_ids) == [11, 12]
        with pytest.raises(AuthenticationError) as err:
            await worker.reset_prefix_cache()
        assert err.value.code == PERMISSION_DENIED
        assert "control key" in err.value.details and API_KEY not in str(err.value)
    async with WorkerClient(both.address, api_key=API_KEY, control_api_key=CONTROL_KEY) as worker:
        assert await worker.reset_prefix_cache() is True
        assert list((await worker.generate([10], max_tokens=2)).output_token_ids) == [11, 12]


def test_client_cli_reads_the_control_key_from_its_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(CONTROL_API_KEY_ENV, raising=False)
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert client_parser().parse_args(["info"]).control_api_key is None
    monkeypatch.setenv(CONTROL_API_KEY_ENV, "from-env")
    assert client_parser().parse_args(["info"]).control_api_key == "from-env"
    assert client_parser().parse_args(["info"]).api_key is None
    flagged = client_parser().parse_args(["--control-api-key", "flag", "info"])
    assert flagged.control_api_key == "flag"
    after = client_parser().parse_args(["info", "--control-api-key", "after"])
    assert after.control_api_key == "after"


# -- metrics ---------------------------------------------------------------------------------


async def test_refused_calls_are_counted_and_never_reach_a_handler(
    start_mock: StartServer,
) -> None:
    """rejected_total{cause="unauthenticated"} counts every refusal; requests_total, which
    the handlers count, sees only the call that had the key."""
    harness = await start_mock(config(api_key=API_KEY, control_api_key=CONTROL_KEY, metrics_port=0))
    version = next(m for s, m in CONTROL_RPCS if m.name == "GetWeightVersion")
    before = await scrape(harness.metrics_url)
    codes = [
        (await call(harness.channel, "vllm.Control", version, metadata)).code
        for metadata in (None, bearer(WRONG_KEY), bearer(API_KEY), bearer(CONTROL_KEY))
    ]
    assert codes == [UNAUTHENTICATED, UNAUTHENTICATED, PERMISSION_DENIED, grpc.StatusCode.OK]
    with pytest.raises(grpc.aio.AioRpcError) as err:  # a router RPC without its key
        await harness.stub.Generate(request([10], max_tokens=1))
    assert err.value.code() == UNAUTHENTICATED
    after = await scrape(harness.metrics_url)
    rejected = delta(before, after, "vllm_servicer:rejected_total", cause="unauthenticated")
    assert rejected == 4  # both refusals of a control RPC count, as a router RPC's
    finished = {
        code: delta(
            before,
            after,
            "vllm_servicer:requests_total",
            service="vllm.Control",
            method="GetWeightVersion",
            code=code,
        )
        for code in ("OK", "UNAUTHENTICATED", "PERMISSION_DENIED")
    }
    assert finished == {"OK": 1, "UNAUTHENTICATED": 0, "PERMISSION_DENIED": 0}
