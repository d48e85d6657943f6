"""vLLM's native contract (vllm.Inference + vllm.Control) on the mock engine, same server.

Message shapes follow vllm-rs: a first message with the prompt's facts only, then one
message per sequence per engine step, `finish_info` on each sequence's last; Generate
answers once with all of it.
"""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
import pytest
from google.protobuf import struct_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from vllm_router.proto import vllm_native_pb2 as npb
from vllm_router.proto import vllm_native_pb2_grpc as npb_grpc
from vllm_router.server import ServerConfig

from harness import Harness, StartServer, real_engine_idle, request, wait_until  # noqa: F401

EOS = 2  # the mock's EOS id: after 31999 it generates 0, 1, 2


def native(
    ids: list[int] | None = None, text: str | None = None, **fields: object
) -> npb.GenerateRequest:
    """A GenerateRequest; `fields` are its sub-messages' fields by (message, field) name."""
    req = npb.GenerateRequest(**fields)  # type: ignore[arg-type]
    if text is not None:
        req.text = text
    else:
        req.token_ids.ids.extend(ids or [])
    return req


def stopping(max_new: int, **more: object) -> npb.StoppingCriteria:
    return npb.StoppingCriteria(max_new_tokens=max_new, **more)  # type: ignore[arg-type]


def ids_out() -> npb.ResponseOptions:
    return npb.ResponseOptions(output_token_ids=True)


def inference(harness: Harness) -> npb_grpc.InferenceStub:
    return npb_grpc.InferenceStub(harness.channel)


def control(harness: Harness) -> npb_grpc.ControlStub:
    return npb_grpc.ControlStub(harness.channel)


async def _stream(
    harness: Harness, req: npb.GenerateRequest, **kwargs: object
) -> list[npb.GenerateResponse]:
    return [m async for m in inference(harness).GenerateStream(req, **kwargs)]  # type: ignore[arg-type]


async def _code(call: object) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        result = await call  # type: ignore[misc]
        if hasattr(result, "__aiter__"):
            [_ async for _ in result]
    return err.value.code()


async def _stream_error(
    harness: Harness, req: npb.GenerateRequest, **kwargs: object
) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _stream(harness, req, **kwargs)
    return err.value


async def test_stream_is_prompt_info_then_a_message_per_step(mock: Harness) -> None:
    messages = await _stream(mock, native([10, 11], stopping=stopping(3), response=ids_out()))
    assert messages[0].HasField("prompt_info") and not messages[0].HasField("outputs")
    assert messages[0].prompt_info.num_prompt_tokens == 2
    steps = [m.outputs for m in messages[1:]]
    assert [list(s.token_ids) for s in steps] == [[12], [13], [14]]
    assert [s.num_tokens for s in steps] == [1, 1, 1]
    assert [s.text for s in steps] == [" 12", " 13", " 14"]  # output_text defaults to true
    assert [s.HasField("finish_info") for s in steps] == [False, False, True]
    finish = steps[-1].finish_info
    assert (finish.finish_reason, finish.num_output_tokens) == (npb.LENGTH, 3)
    assert finish.WhichOneof("stop_reason") is None


async def test_stop_reasons_name_what_matched(mock: Harness) -> None:
    by_id = await _stream(mock, native([10], stopping=stopping(9, stop_token_ids=[12])))
    finish = by_id[-1].outputs.finish_info
    assert (finish.finish_reason, finish.stop_token_id) == (npb.STOP, 12)
    eos = await _stream(mock, native([31999], stopping=stopping(9), response=ids_out()))
    assert eos[-1].outputs.finish_info.eos_token_id == EOS
    assert eos[-1].outputs.finish_info.WhichOneof("stop_reason") == "eos_token_id"
    text = await _stream(mock, native([10], stopping=stopping(9, stop_strings=[" 13"])))
    assert text[-1].outputs.finish_info.stop_string == " 13"
    assert "".join(m.outputs.text for m in text[1:]) == " 11 12"


async def test_text_off_token_ids_only(mock: Harness) -> None:
    response = npb.ResponseOptions(output_text=False, output_token_ids=True)
    messages = await _stream(mock, native([10], stopping=stopping(2), response=response))
    assert [m.outputs.text for m in messages[1:]] == ["", ""]
    assert [list(m.outputs.token_ids) for m in messages[1:]] == [[11], [12]]


async def test_no_max_generates_until_the_context_is_full(start_mock: StartServer) -> None:
    harness = await start_mock(max_model_len=8)
    messages = await _stream(harness, native([10, 11, 12], response=ids_out()))
    tokens = [t for m in messages[1:] for t in m.outputs.token_ids]
    assert len(tokens) == 5
    assert messages[-1].outputs.finish_info.finish_reason == npb.LENGTH


async def test_sequences_and_their_logprobs(mock: Harness) -> None:
    req = native(
        [10],
        temperature=0.7,
        sampling=npb.RandomSampling(num_sequences=2, seed=3),
        stopping=stopping(2),
        response=npb.ResponseOptions(
            output_token_ids=True,
            output_logprobs=True,
            output_candidates=npb.CandidateTokens(top_n=2),
        ),
    )
    messages = await _stream(mock, req)
    by_index: dict[int, list[int]] = {}
    for m in messages[1:]:
        by_index.setdefault(m.outputs.index, []).extend(m.outputs.token_ids)
        assert list(m.outputs.logprobs) == [-0.5]
        assert [[t.id for t in c.tokens] for c in m.outputs.candidate_tokens] == [
            [m.outputs.token_ids[0], m.outputs.token_ids[0] + 1]
        ]
    assert by_index == {0: [11, 12], 1: [12, 13]}


async def test_unary_generate_answers_once(mock: Harness) -> None:
    req = native([10], stopping=stopping(3), response=npb.ResponseOptions(
        output_token_ids=True, prompt_token_ids=True))  # fmt: skip
    answer = await inference(mock).Generate(req)
    assert answer.prompt_info.num_prompt_tokens == 1
    assert list(answer.prompt_info.token_ids) == [10]
    assert list(answer.outputs.token_ids) == [11, 12, 13]
    assert answer.outputs.text == " 11 12 13"
    assert answer.outputs.num_tokens == 3
    assert answer.outputs.finish_info.finish_reason == npb.LENGTH


async def test_unary_generate_refuses_more_than_one_sequence(mock: Harness) -> None:
    req = native([10], temperature=0.7, sampling=npb.RandomSampling(num_sequences=2),
                 stopping=stopping(2))  # fmt: skip
    err = await _code(inference(mock).Generate(req))
    assert err == grpc.StatusCode.INVALID_ARGUMENT
    assert not mock.engine.last_request  # refused before it reached the engine
    assert len(await _stream(mock, req)) == 5  # served on GenerateStream: 2 x 2 steps


async def test_text_prompt_echoed_as_ids(mock: Harness) -> None:
    req = native(text="hi", stopping=stopping(1),
                 response=npb.ResponseOptions(prompt_token_ids=True))  # fmt: skip
    messages = await _stream(mock, req)
    assert list(messages[0].prompt_info.token_ids) == list(b"hi")
    assert messages[0].prompt_info.num_prompt_tokens == 2


async def test_kv_transfer_params_reach_the_engine(mock: Harness) -> None:
    params = struct_pb2.Struct()
    params.update({"do_remote_decode": True, "remote_port": 7})
    req = native([10], stopping=stopping(1), kv=npb.KVCacheParameters(
        kv_transfer_params=params, cache_salt="s", bypass_prefix_cache=True))  # fmt: skip
    await _stream(mock, req)
    seen = mock.engine.last_request
    assert seen.kv_transfer_params == {"do_remote_decode": True, "remote_port": 7.0}
    assert (seen.cache_salt, seen.skip_prefix_cache) == ("s", True)
    await _stream(mock, native([10], stopping=stopping(1), session_id="conversation-1"))
    assert mock.engine.last_request.session_id == "conversation-1"


async def test_unset_values_as_vllm_rs_reads_them(mock: Harness) -> None:
    await _stream(mock, native([10], stopping=stopping(1)))
    s = mock.engine.last_request.sampling
    assert (s.temperature, s.top_p, s.top_k, s.repetition_penalty, s.n) == (
        0.0,
        None,
        None,
        None,
        1,
    )
    assert (s.max_tokens, s.logprobs, s.prompt_logprobs) == (1, None, None)
    # Candidates count only with output_logprobs, as vllm-rs reads them.
    candidates = npb.CandidateTokens(top_n=3)
    response = npb.ResponseOptions(output_candidates=candidates)
    await _stream(mock, native([10], stopping=stopping(1), response=response))
    assert mock.engine.last_request.sampling.logprobs is None


async def test_truncation_keeps_the_last_tokens(mock: Harness) -> None:
    messages = await _stream(mock, native([5, 6, 7, 8], truncate_prompt_tokens=2,
                                          stopping=stopping(1)))  # fmt: skip
    assert messages[0].prompt_info.num_prompt_tokens == 2
    assert mock.engine.last_request.prompt_token_ids == [7, 8]
    echo = npb.ResponseOptions(prompt_token_ids=True)
    req = native(text="abcd", truncate_prompt_tokens=3, stopping=stopping(1), response=echo)
    text = await _stream(mock, req)
    assert list(text[0].prompt_info.token_ids) == list(b"bcd")


def _rejected(harness: Harness, cause: str) -> float:
    metrics = harness.server.metrics
    assert metrics is not None
    value = metrics.registry.get_sample_value("vllm_servicer:rejected_total", {"cause": cause})
    return value or 0.0


@pytest.mark.parametrize(
    ("response", "keep", "ids"),
    [(npb.ResponseOptions(prompt_token_ids=True), 0, list(b"abcd")), (None, 3, list(b"bcd"))],
    ids=["echoed", "truncated"],
)
async def test_a_text_prompt_is_tokenized_by_admission(
    start_mock: StartServer,
    monkeypatch: pytest.MonkeyPatch,
    response: npb.ResponseOptions | None,
    keep: int,
    ids: list[int],
) -> None:
    """A text prompt whose ids the servicer needs first (to echo or truncate them) is
    tokenized at admission: after the model-kind and serving checks, refusals counted."""
    harness = await start_mock(ServerConfig(port=0, metrics_port=0))
    engine = harness.engine
    tokenized: list[str] = []
    tokenize = engine.tokenize

    async def counting(text: str) -> list[int]:
        tokenized.append(text)
        return await tokenize(text)

    monkeypatch.setattr(engine, "tokenize", counting)
    req = native(text="abcd", stopping=stopping(1), response=response, truncate_prompt_tokens=keep)
    messages = await _stream(harness, req)
    assert tokenized == ["abcd"] and engine.last_request.prompt_token_ids == ids
    assert messages[0].prompt_info.num_prompt_tokens == len(ids)

    facts = engine.facts
    monkeypatch.setattr(engine, "_facts", dataclasses.replace(facts, is_generation=False))
    err = await _stream_error(harness, req)
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "pooling" in err.details()
    assert _rejected(harness, "wrong_model_kind") == 1
    monkeypatch.setattr(engine, "_facts", facts)

    harness.server.requests.start_draining()
    assert await _code(inference(harness).Generate(req)) == grpc.StatusCode.UNAVAILABLE
    assert (await _stream_error(harness, req)).code() == grpc.StatusCode.UNAVAILABLE
    assert _rejected(harness, "not_serving") == 2
    # A truncation past the context is the request's own fault, found before admission.
    too_far = native(text="abcd", truncate_prompt_tokens=100_000, response=response)
    assert (await _stream_error(harness, too_far)).code() == grpc.StatusCode.INVALID_ARGUMENT
    assert tokenized == ["abcd"]  # every refusal came before tokenizing


async def test_preprocessed_media_on_a_multimodal_model_is_unimplemented(
    start_mock: StartServer,
) -> None:
    harness = await start_mock(image_token_id=7)
    req = native([7], media=[npb.MediaItem(features=npb.PreprocessedMediaFeatures())])
    err = await _stream_error(harness, req)
    assert err.code() == grpc.StatusCode.UNIMPLEMENTED and "features" in err.details()


async def test_dp_rank_from_metadata(start_mock: StartServer) -> None:
    harness = await start_mock(dp_size=2)
    await _stream(harness, native([10], stopping=stopping(1)),
                  metadata=(("x-data-parallel-rank", "1"),))  # fmt: skip
    assert harness.engine.last_request.dp_rank == 1
    for bad in ("2", "-1", "one"):
        err = await _stream_error(harness, native([10], stopping=stopping(1)),
                                  metadata=(("x-data-parallel-rank", bad),))  # fmt: skip
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, bad
        assert "x-data-parallel-rank" in (err.details() or "")


@pytest.mark.parametrize(
    ("req", "code", "words"),
    [
        (native([]), grpc.StatusCode.INVALID_ARGUMENT, "token_ids"),
        (native(text=""), grpc.StatusCode.INVALID_ARGUMENT, "text"),
        (native([10] * 5000), grpc.StatusCode.INVALID_ARGUMENT, "token_ids"),
        (native([10], model="other"), grpc.StatusCode.NOT_FOUND, "other"),
        (npb.GenerateRequest(), grpc.StatusCode.INVALID_ARGUMENT, "prompt is required"),
        (
            native([10], truncate_prompt_tokens=100_000),
            grpc.StatusCode.INVALID_ARGUMENT,
            "truncate_prompt_tokens",
        ),
        (
            native(
                [10],
                response=npb.ResponseOptions(
                    prompt_logprobs=True,
                    prompt_candidates=(npb.CandidateTokens(token_ids=npb.TokenIds(ids=[1]))),
                ),
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "prompt_candidates",
        ),
        (native([10], watermarking=True), grpc.StatusCode.UNIMPLEMENTED, "watermarking"),
        (native([10], temperature=-1), grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
        (
            native([10], decoding=npb.DecodingParameters(presence_penalty=5)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "presence_penalty",
        ),
        (
            native(
                [10], decoding=npb.DecodingParameters(bad_words_token_ids=[npb.TokenIds(ids=[1])])
            ),
            grpc.StatusCode.UNIMPLEMENTED,
            "bad_words_token_ids",
        ),
        (
            native([10], stopping=npb.StoppingCriteria(thinking_token_budget=-2)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "`thinking_token_budget` must be a non-negative integer or -1 for unlimited.",
        ),
        (
            native([10], kv=npb.KVCacheParameters(ec_transfer_params=struct_pb2.Struct())),
            grpc.StatusCode.UNIMPLEMENTED,
            "ec_transfer_params",
        ),
        (
            # As vllm-rs: media for a text-only model is the client's mistake.
            native([10], media=[npb.MediaItem(features=npb.PreprocessedMediaFeatures())]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "multimodal input is not supported",
        ),
        (native([10], media=[npb.MediaItem()]), grpc.StatusCode.INVALID_ARGUMENT, "media[0]"),
        (
            native(text="hi", media=[npb.MediaItem(data_uri="data:,x")]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "token_ids prompt",
        ),
        (native([10], lora_name="x"), grpc.StatusCode.FAILED_PRECONDITION, "--enable-lora"),
        (native([10], request_id="r" * 300), grpc.StatusCode.INVALID_ARGUMENT, "request_id"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
async def test_bad_input_has_a_clear_status(
    mock: Harness, req: npb.GenerateRequest, code: grpc.StatusCode, words: str
) -> None:
    err = await _stream_error(mock, req)
    assert err.code() == code, err.details()
    assert words in (err.details() or ""), err.details()
    assert not mock.server.requests.in_flight


@pytest.mark.parametrize(
    "req",
    [
        native([]),
        native([10] * 5000),
        native([10], temperature=-1),
        native([10], stopping=npb.StoppingCriteria(max_new_tokens=2, min_new_tokens=5)),
        native(text="hi", media=[npb.MediaItem(data_uri="data:,x")]),
        native([10], media=[npb.MediaItem(features=npb.PreprocessedMediaFeatures())]),
    ],
    ids=[
        "empty prompt",
        "prompt over the context",
        "temperature",
        "min over max",
        "media on a text prompt",
        "preprocessed media on a text-only model",
    ],
)
async def test_a_lora_without_lora_is_named_before_the_rest(
    mock: Harness, req: npb.GenerateRequest
) -> None:
    """As vllm-rs: a request naming a LoRA on a worker without LoRA is FAILED_PRECONDITION,
    whatever else is wrong with its prompt, sampling values or media."""
    req.lora_name = "adapter"
    with pytest.raises(grpc.aio.AioRpcError) as unary:
        await inference(mock).Generate(req)
    for err in (unary.value, await _stream_error(mock, req)):
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION, err.details()
        assert "--enable-lora" in (err.details() or "")
    assert mock.engine.last_request is None


async def test_abort_and_dropped_streams_leave_nothing_running(start_mock: StartServer) -> None:
    harness = await start_mock(step_delay=0.01)
    call = inference(harness).GenerateStream(native([10], request_id="a", stopping=stopping(500)))
    await call.read()
    await call.read()
    await control(harness).Abort(npb.AbortRequest(request_ids=["a", "unknown"]))
    rest = []
    while (message := await call.read()) is not grpc.aio.EOF:
        rest.append(message)
    assert rest[-1].outputs.finish_info.finish_reason == npb.ABORTED
    dropped = inference(harness).GenerateStream(
        native([10], request_id="b", stopping=stopping(500))
    )
    await dropped.read()
    dropped.cancel()
    await wait_until(lambda: not harness.server.requests.in_flight, what="the dropped stream ends")
    assert "b" in harness.engine.aborted_ids


async def test_one_request_id_space_with_our_contract(start_mock: StartServer) -> None:
    harness = await start_mock(step_delay=0.02)
    ours = harness.stub.GenerateStream(request([10], "shared", max_tokens=500))
    await ours.read()
    err = await _stream_error(harness, native([10], request_id="shared", stopping=stopping(2)))
    assert err.code() == grpc.StatusCode.ALREADY_EXISTS
    ours.cancel()


async def test_control_facts(mock: Harness) -> None:
    info = await control(mock).GetServerInfo(npb.GetServerInfoRequest())
    again = await control(mock).GetServerInfo(npb.GetServerInfoRequest())
    facts = mock.engine.facts
    assert info.instance_id and info.instance_id == again.instance_id
    assert (info.max_model_len, info.kv_block_size) == (facts.max_model_len, facts.block_size)
    assert info.parallelism.data_parallel_size == facts.dp_size
    assert info.api_version == "vllm"
    model = await control(mock).GetModelInfo(npb.GetModelInfoRequest())
    assert (model.model_id, model.served_model_name) == (facts.model_name, facts.served_model_name)
    assert model.supports_text_input and model.supports_token_ids_input
    assert not model.supports_lora and not model.supports_multimodal
    sources = await control(mock).GetKvEventSources(npb.GetKvEventSourcesRequest())
    assert list(sources.sources) == []


async def test_control_pause_keep_freezes_and_resume_continues(start_mock: StartServer) -> None:
    harness = await start_mock(step_delay=0.005)
    ctl = control(harness)
    call = inference(harness).GenerateStream(native([10], stopping=stopping(20)))
    await call.read()
    await ctl.PauseGeneration(npb.PauseGenerationRequest(mode=npb.PAUSE_MODE_KEEP))
    assert (await ctl.IsPaused(npb.IsPausedRequest())).paused
    await asyncio.sleep(0.05)
    assert harness.server.requests.in_flight  # frozen, not ended
    await ctl.ResumeGeneration(npb.ResumeGenerationRequest())
    assert not (await ctl.IsPaused(npb.IsPausedRequest())).paused
    rest = []
    while (message := await call.read()) is not grpc.aio.EOF:
        rest.append(message)
    assert rest[-1].outputs.finish_info.num_output_tokens == 20


async def test_control_pause_abort_ends_requests(start_mock: StartServer) -> None:
    harness = await start_mock(step_delay=0.005)
    ctl = control(harness)
    call = inference(harness).GenerateStream(native([10], stopping=stopping(500)))
    await call.read()
    await ctl.PauseGeneration(npb.PauseGenerationRequest())  # UNSPECIFIED: abort
    rest = []
    while (message := await call.read()) is not grpc.aio.EOF:
        rest.append(message)
    assert rest[-1].outputs.finish_info.finish_reason == npb.ABORTED
    await ctl.ResumeGeneration(npb.ResumeGenerationRequest())
    assert (await _stream(harness, native([10], stopping=stopping(1))))[-1].outputs.finish_info


async def test_control_what_is_not_served_says_why(mock: Harness) -> None:
    ctl = control(mock)
    cases = [
        (ctl.ListLoras(npb.ListLorasRequest()), grpc.StatusCode.FAILED_PRECONDITION),
        (ctl.UnloadLora(npb.UnloadLoraRequest(lora_name="a")), grpc.StatusCode.FAILED_PRECONDITION),
        (ctl.LoadLora(npb.LoadLoraRequest(lora_name="a")), grpc.StatusCode.INVALID_ARGUMENT),
        (ctl.Sleep(npb.SleepRequest()), grpc.StatusCode.FAILED_PRECONDITION),
        # Sleep mode is checked first, as vllm-rs 0.34 does: before the level and the mode.
        (ctl.Sleep(npb.SleepRequest(level=3)), grpc.StatusCode.FAILED_PRECONDITION),
        (ctl.Sleep(npb.SleepRequest(mode=9)), grpc.StatusCode.FAILED_PRECONDITION),  # type: ignore[arg-type]
        (
            ctl.PauseGeneration(npb.PauseGenerationRequest(mode=9)),  # type: ignore[arg-type]
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        (ctl.Shutdown(npb.ShutdownRequest()), grpc.StatusCode.FAILED_PRECONDITION),
        (ctl.UpdateWeights(npb.UpdateWeightsRequest()), grpc.StatusCode.FAILED_PRECONDITION),
        (
            ctl.InitWeightTransferEngine(npb.InitWeightTransferEngineRequest()),
            grpc.StatusCode.FAILED_PRECONDITION,
        ),
        (
            ctl.UpdateWeightVersion(npb.UpdateWeightVersionRequest(weight_version=" ")),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
    ]
    for call, code in cases:
        assert await _code(call) == code
    assert not (await ctl.IsSleeping(npb.IsSleepingRequest())).sleeping
    version = await ctl.GetWeightVersion(npb.GetWeightVersionRequest())
    assert version.weight_version == "default"
    await ctl.UpdateWeightVersion(npb.UpdateWeightVersionRequest(weight_version="v2"))
    version = await ctl.GetWeightVersion(npb.GetWeightVersionRequest())
    assert version.weight_version == "v2"


async def test_health_and_reflection_name_both_services(mock: Harness) -> None:
    health = health_pb2_grpc.HealthStub(mock.channel)
    for service in ("vllm.Inference", "vllm.Control"):
        answer = await health.Check(health_pb2.HealthCheckRequest(service=service))
        assert answer.status == health_pb2.HealthCheckResponse.SERVING


async def test_the_flag_turns_the_contract_off(start_mock: StartServer) -> None:
    harness = await start_mock(ServerConfig(port=0, vllm_native=False))
    assert await _code(inference(harness).Generate(native([10]))) == grpc.StatusCode.UNIMPLEMENTED
    health = health_pb2_grpc.HealthStub(harness.channel)
    assert await _code(health.Check(health_pb2.HealthCheckRequest(service="vllm.Inference"))) == (
        grpc.StatusCode.NOT_FOUND
    )
