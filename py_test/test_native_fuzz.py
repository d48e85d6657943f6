"""Fuzzing vLLM's native contract on the mock: arbitrary vllm.Inference requests (and Control
calls) never yield INTERNAL/UNKNOWN, always say why they are refused, and leave nothing
running; on a worker with a control key, whatever credential they carry, router RPCs are
never refused for it and control RPCs are refused unless they carry that key."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor, MethodDescriptor
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import given
from hypothesis import strategies as st
from test_control_key import CONTROL_KEY, CONTROL_RPCS, WRONG_KEY, bearer
from test_fuzz import ALLOWED, EXAMPLES, FUZZ, IMAGE_TOKEN, floats, u32

from vllm_router.proto import vllm_native_pb2 as npb
from vllm_router.proto import vllm_native_pb2_grpc as npb_grpc
from vllm_router.server import ServerConfig

from harness import StartServer

# A model this worker does not serve, a LoRA it has not loaded.
NATIVE_ALLOWED = ALLOWED | {grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION}


def mostly(plausible: st.SearchStrategy, wild: st.SearchStrategy) -> st.SearchStrategy:
    """Plausible values three times in four: enough requests get through to generation."""
    return st.integers(0, 3).flatmap(lambda pick: wild if pick == 3 else plausible)


small = mostly(st.integers(0, 6), u32)
fair = mostly(st.sampled_from([0.0, 0.5, 1.0]), floats)
token_ids = st.builds(npb.TokenIds, ids=st.lists(st.integers(0, 40) | u32, max_size=8))
candidates = st.one_of(
    st.builds(npb.CandidateTokens, top_n=st.integers(0, 30) | u32),
    st.builds(npb.CandidateTokens, token_ids=token_ids),
    st.builds(npb.CandidateTokens, all=st.booleans()),
)
constraint: st.SearchStrategy[dict[str, Any]] = st.one_of(
    st.just({}),
    st.builds(dict, json=st.sampled_from(['{"type": "object"}', "{", ""])),
    st.builds(dict, regex=st.sampled_from(["[a-z]+", "(", ""])),
    st.builds(dict, choice=st.builds(npb.StringChoices, choices=st.lists(st.text(max_size=3),
                                                                         max_size=3))),
    st.builds(dict, grammar=st.sampled_from(['root ::= "a"', "nonsense", ""])),
    st.builds(dict, json_object=st.booleans()),
)  # fmt: skip
media = (
    st.builds(
        npb.MediaItem,
        modality=st.sampled_from([0, 1, 2, 3, 9]),
        url=st.sampled_from(["", "http://127.0.0.1:1/x", "file:///etc/passwd", "gopher://x"]),
        uuid=st.text(max_size=3),
    )
    | st.builds(npb.MediaItem, raw_bytes=st.binary(max_size=32))
    | st.builds(
        npb.MediaItem, data_uri=st.sampled_from(["data:,x", "data:image/png;base64,!!", ""])
    )
)


@st.composite
def native_requests(draw: st.DrawFn) -> tuple[npb.GenerateRequest, tuple]:
    request = npb.GenerateRequest(
        request_id=draw(st.text(max_size=8)),
        model=draw(mostly(st.sampled_from(["", "mock-model"]), st.just("other"))),
        sampling=npb.RandomSampling(num_sequences=draw(st.integers(0, 3)),
                                    top_k=draw(small), top_p=draw(fair), min_p=draw(fair)),
        decoding=npb.DecodingParameters(presence_penalty=draw(fair),
                                        frequency_penalty=draw(fair),
                                        repetition_penalty=draw(fair),
                                        logit_bias=draw(st.dictionaries(st.integers(0, 40) | u32,
                                                                        floats, max_size=2)),
                                        allowed_token_ids=draw(st.lists(u32, max_size=2)),
                                        **draw(constraint)),
        stopping=npb.StoppingCriteria(max_new_tokens=draw(small),
                                      min_new_tokens=draw(mostly(st.just(0), small)),
                                      stop_token_ids=draw(st.lists(u32, max_size=2)),
                                      stop_strings=draw(st.lists(st.text(max_size=3),
                                                                 max_size=2)),
                                      include_stop_strings=draw(st.booleans()),
                                      ignore_eos=draw(st.booleans())),
        response=npb.ResponseOptions(prompt_token_ids=draw(st.booleans()),
                                     prompt_logprobs=draw(st.booleans()),
                                     output_token_ids=draw(st.booleans()),
                                     output_logprobs=draw(st.booleans())),
        truncate_prompt_tokens=draw(mostly(st.just(0), small)),
        priority=draw(st.integers(-(2**31), 2**31 - 1)),
        lora_name=draw(mostly(st.just(""), st.just("adapter"))),
        media=draw(mostly(st.just([]), st.lists(media, max_size=2))),
    )  # fmt: skip
    if draw(st.booleans()):
        request.text = draw(st.text(max_size=12))
    else:
        request.token_ids.CopyFrom(draw(token_ids))
    if draw(st.booleans()):
        request.temperature = draw(fair)
    if draw(st.booleans()):
        request.sampling.seed = draw(st.integers(-(2**63), 2**63 - 1))
    for part in ("output_candidates", "prompt_candidates"):
        if draw(st.booleans()):
            getattr(request.response, part).CopyFrom(draw(candidates))
    if draw(st.integers(0, 5)) == 0:
        request.session_id = draw(st.text(max_size=4))
    ranks = st.sampled_from(
        [
            (),
            (("x-data-parallel-rank", "1"),),
            (("x-data-parallel-rank", "5"),),
            (("x-data-parallel-rank", "x"),),
        ]
    )
    return request, draw(mostly(st.just(()), ranks))  # fmt: skip


@st.composite
def good_requests(draw: st.DrawFn) -> tuple[npb.GenerateRequest, tuple]:
    """Requests the mock serves: every field drawn within what it implements."""
    request = npb.GenerateRequest(
        token_ids=npb.TokenIds(ids=draw(st.lists(st.integers(0, 40), min_size=1, max_size=6))),
        temperature=draw(st.sampled_from([0.0, 0.5, 1.0])),
        sampling=npb.RandomSampling(num_sequences=draw(st.integers(0, 2)),
                                    top_k=draw(st.integers(0, 5))),
        decoding=npb.DecodingParameters(logit_bias=draw(st.dictionaries(
            st.integers(0, 40), st.sampled_from([100.0, -100.0]), max_size=1))),
        stopping=npb.StoppingCriteria(max_new_tokens=draw(st.integers(0, 5)),
                                      stop_token_ids=draw(st.lists(st.integers(0, 40), max_size=2)),
                                      stop_strings=draw(st.lists(st.sampled_from([" 1", "2"]),
                                                                 max_size=1)),
                                      ignore_eos=draw(st.booleans())),
        response=npb.ResponseOptions(output_token_ids=draw(st.booleans()),
                                     output_text=draw(st.booleans()),
                                     prompt_token_ids=draw(st.booleans()),
                                     output_logprobs=draw(st.booleans())),
    )  # fmt: skip
    return request, draw(st.sampled_from([(), (("x-data-parallel-rank", "1"),)]))


# What a caller may carry to a worker started with CONTROL_KEY: nothing, a wrong key, the key.
credentials = st.sampled_from([(), bearer(WRONG_KEY), bearer(CONTROL_KEY)])
CONTROLLED = ServerConfig(port=0, shutdown_grace_seconds=2.0, control_api_key=CONTROL_KEY)


def _fuzz(address: str) -> dict[str, int]:
    seen: dict[str, int] = {}
    with grpc.insecure_channel(address) as channel:
        inference = npb_grpc.InferenceStub(channel)

        @FUZZ
        @given(good_requests() | native_requests(), st.booleans(), credentials)
        def requests(
            drawn: tuple[npb.GenerateRequest, tuple], streamed: bool, credential: tuple
        ) -> None:
            # A router RPC: no credential is needed, none refused (UNAUTHENTICATED is not
            # in NATIVE_ALLOWED).
            request, metadata = drawn[0], (*drawn[1], *credential)
            try:
                if streamed:
                    for _ in inference.GenerateStream(request, timeout=10, metadata=metadata):
                        pass
                else:
                    inference.Generate(request, timeout=10, metadata=metadata)
                code, details = grpc.StatusCode.OK, ""
            except grpc.RpcError as err:
                code, details = err.code(), err.details()
            seen[code.name] = seen.get(code.name, 0) + 1
            assert code in NATIVE_ALLOWED, (code, details, request)
            assert code == grpc.StatusCode.OK or details, (code, request)

        requests()
    return seen


async def test_fuzzed_native_requests_never_break_the_server(
    start_mock: StartServer, figures
) -> None:
    mock = await start_mock(CONTROLLED, image_token_id=IMAGE_TOKEN, max_images=2, dp_size=2)
    seen = await asyncio.to_thread(_fuzz, mock.address)
    figures(f"{EXAMPLES} fuzzed native requests; status codes seen: {seen}")
    assert seen.get("OK", 0) > 0 and seen.get("INVALID_ARGUMENT", 0) > 0
    assert mock.server.requests.in_flight == frozenset()
    assert mock.engine.load().running_requests == 0


async def test_fuzzed_control_calls_answer_or_say_why(start_mock: StartServer) -> None:
    mock = await start_mock(step_delay=0.001)
    control = npb_grpc.ControlStub(mock.channel)
    calls = [
        control.PauseGeneration(npb.PauseGenerationRequest(mode=7)),  # type: ignore[arg-type]
        control.Sleep(npb.SleepRequest(level=0)),
        control.Sleep(npb.SleepRequest(mode=9)),  # type: ignore[arg-type]
        control.WakeUp(npb.WakeUpRequest(tags=["weights"])),
        control.LoadLora(npb.LoadLoraRequest()),
        control.UnloadLora(npb.UnloadLoraRequest(lora_name=" ")),
        control.FinishWeightUpdate(npb.FinishWeightUpdateRequest(weight_version="")),
        control.StartDraftWeightUpdate(npb.StartDraftWeightUpdateRequest()),
        control.Abort(npb.AbortRequest(request_ids=["", "x" * 1000])),
    ]
    for call in calls:
        try:
            await call
        except grpc.aio.AioRpcError as err:
            assert err.code() in NATIVE_ALLOWED and err.details(), (err.code(), err.details())
    assert not (await control.IsPaused(npb.IsPausedRequest())).paused


_INTEGERS = {
    FieldDescriptor.TYPE_INT32: st.integers(-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_INT64: st.integers(-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT32: u32,
    FieldDescriptor.TYPE_UINT64: st.integers(0, 2**64 - 1),
    FieldDescriptor.TYPE_ENUM: st.integers(0, 9),  # an unknown value included
}
_JSONISH = st.sampled_from([b"", b"{}", b"{", b"[]", b'{"path": "a"}', b"null"]) | st.binary(
    max_size=12
)


def _field_values(field: FieldDescriptor) -> st.SearchStrategy[Any]:
    """Values for one scalar field of a request message."""
    kind = field.type
    if kind == FieldDescriptor.TYPE_STRING:
        value: st.SearchStrategy[Any] = st.sampled_from(
            ["", " ", "a", "v1", "/tmp", "..", "adapter"]
        )
        value |= st.text(max_size=8)
    elif kind == FieldDescriptor.TYPE_BYTES:
        value = _JSONISH
    elif kind == FieldDescriptor.TYPE_BOOL:
        value = st.booleans()
    elif kind in (FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_DOUBLE):
        value = floats
    else:
        value = _INTEGERS.get(kind, st.integers(0, 9))
    return st.lists(value, max_size=3) if field.is_repeated else value


def _payloads(message: Descriptor) -> st.SearchStrategy[bytes]:
    """A request's bytes: `message` with drawn fields, or bytes that may not parse at all."""
    cls = message_factory.GetMessageClass(message)
    fields = {f.name: _field_values(f) for f in message.fields}
    built = st.fixed_dictionaries({}, optional=fields).map(
        lambda values: cls(**values).SerializeToString()
    )
    return mostly(built, st.binary(max_size=16))


# Every contract's control RPCs (test_control_key.py derives them from the registry), the
# control key drawn more often than no key or a wrong one (so that many reach their handlers).
control_calls = st.sampled_from(CONTROL_RPCS).flatmap(
    lambda rpc: st.tuples(
        st.just(rpc), _payloads(rpc[1].input_type), credentials | st.just(bearer(CONTROL_KEY))
    )
)


def _fuzz_control(address: str) -> dict[str, int]:
    seen: dict[str, int] = {}
    with grpc.insecure_channel(address) as channel:

        @FUZZ
        @given(control_calls)
        def calls(drawn: tuple[tuple[str, MethodDescriptor], bytes, tuple]) -> None:
            (service, method), payload, credential = drawn
            name = f"{service}/{method.name}"
            rpc = channel.unary_unary(f"/{name}")
            try:
                rpc(payload, timeout=10, metadata=credential)
                code, details = grpc.StatusCode.OK, ""
            except grpc.RpcError as err:
                code, details = err.code(), err.details()
            keyed = credential == bearer(CONTROL_KEY)
            kind = code.name if keyed else f"{code.name} (no key)"
            seen[kind] = seen.get(kind, 0) + 1
            if not keyed:
                assert code == grpc.StatusCode.UNAUTHENTICATED, (name, code, details, payload)
                assert name in details and CONTROL_KEY not in details, details
                return
            assert code in NATIVE_ALLOWED, (name, code, details, payload)
            assert code == grpc.StatusCode.OK or details, (name, code, payload)

        calls()
    return seen


async def test_fuzzed_control_calls_need_the_control_key(start_mock: StartServer, figures) -> None:
    """Any control RPC of any contract, with any request bytes, refused UNAUTHENTICATED
    before its handler unless it carries the control key; with it, answered or told why;
    after all of them the worker serves (once resumed: a keyed pause may have held it)."""
    mock = await start_mock(CONTROLLED, weight_transfer_backend="file")
    seen = await asyncio.to_thread(_fuzz_control, mock.address)
    figures(f"{EXAMPLES} fuzzed control calls; status codes seen: {seen}")
    assert seen.get("UNAUTHENTICATED (no key)", 0) > 0 and seen.get("OK", 0) > 0
    control = npb_grpc.ControlStub(mock.channel)
    await control.ResumeGeneration(npb.ResumeGenerationRequest(), metadata=bearer(CONTROL_KEY))
    health = health_pb2_grpc.HealthStub(mock.channel)
    status = (await health.Check(health_pb2.HealthCheckRequest())).status
    assert status == health_pb2.HealthCheckResponse.SERVING
    request = npb.GenerateRequest(
        token_ids=npb.TokenIds(ids=[10]),
        stopping=npb.StoppingCriteria(max_new_tokens=2),
        response=npb.ResponseOptions(output_token_ids=True),
    )
    answer = await npb_grpc.InferenceStub(mock.channel).Generate(request, timeout=10)
    assert list(answer.outputs.token_ids) == [11, 12]
    assert mock.server.requests.in_flight == frozenset()
