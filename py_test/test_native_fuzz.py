"""Fuzzing vLLM's native contract on the mock: arbitrary vllm.Inference requests (and Control
calls) never yield INTERNAL/UNKNOWN, always say why they are refused, and leave nothing
running."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
from hypothesis import given
from hypothesis import strategies as st
from test_fuzz import ALLOWED, EXAMPLES, FUZZ, IMAGE_TOKEN, floats, u32

from vllm_router.proto import vllm_native_pb2 as npb
from vllm_router.proto import vllm_native_pb2_grpc as npb_grpc

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


def _fuzz(address: str) -> dict[str, int]:
    seen: dict[str, int] = {}
    with grpc.insecure_channel(address) as channel:
        inference = npb_grpc.InferenceStub(channel)

        @FUZZ
        @given(good_requests() | native_requests(), st.booleans())
        def requests(drawn: tuple[npb.GenerateRequest, tuple], streamed: bool) -> None:
            request, metadata = drawn
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
    mock = await start_mock(image_token_id=IMAGE_TOKEN, max_images=2, dp_size=2)
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
