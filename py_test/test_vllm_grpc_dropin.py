"""vLLM's contract as a drop-in for vLLM's own `--grpc` server (the router's e2e suite looks
here): the same request to both workers (same model, engine flags) gets the same answer or
the same status — a max_tokens past the context, and a request wrong in both its prompt and
its sampling values. Real engine on both sides, streamed and not."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc

from harness import Harness, real_engine_idle, wait_until
from real_engine import MAX_MODEL_LEN

pytestmark = pytest.mark.vllm

PROMPT = [5, 17, 29, 41, 53, 65, 77]


def _request(request_id: str, stream: bool, prompt: list[int] | None, **sampling: Any) -> Any:
    message = vpb.GenerateRequest(
        request_id=request_id, sampling_params=vpb.SamplingParams(**sampling), stream=stream
    )
    if prompt is not None:
        message.tokenized.input_ids.extend(prompt)
    return message


async def _outcome(address: str, request: vpb.GenerateRequest) -> Any:
    """What a router takes from the answer: every token, the completes, or the status.

    A streamed complete carries the last step's ids, and vLLM's own server merges steps
    into one delta whenever its handler falls behind its output loop (seen on a loaded
    host: its last delta two tokens, ours one). So a streamed complete is compared as what
    does not depend on that timing: its ids end the token stream and number its count."""
    async with grpc.aio.insecure_channel(address) as channel:
        try:
            replies = [r async for r in vpb_grpc.VllmEngineStub(channel).Generate(request)]
        except grpc.aio.AioRpcError as err:
            return err.code().name, err.details()
    tokens = [t for r in replies if r.HasField("chunk") for t in r.chunk.token_ids]
    completes: list[tuple[Any, ...]] = []
    for c in (r.complete for r in replies if r.HasField("complete")):
        ids = list(c.output_ids)
        if request.stream:
            assert c.completion_tokens == len(ids) and ids == tokens[len(tokens) - len(ids) :]
            completes.append((c.index, c.finish_reason, c.prompt_tokens))
        else:
            completes.append((c.index, c.finish_reason, c.prompt_tokens, c.completion_tokens, ids))
    chunk_tokens = sum(r.chunk.completion_tokens for r in replies if r.HasField("chunk"))
    return tokens, chunk_tokens, completes


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "unary"])
async def test_max_tokens_past_the_context_generates_until_it_is_full(
    real: Harness, vllm_grpc_reference: str, stream: bool
) -> None:
    """OpenAI clients send a fixed large max_tokens: both workers fill the context, "length"."""
    room = MAX_MODEL_LEN - len(PROMPT)
    for max_tokens in (room + 1, 2048):
        request = _request(
            f"past-context-{max_tokens}", stream, PROMPT, max_tokens=max_tokens,
            temperature=0.0, ignore_eos=True,
        )  # fmt: skip
        ours = await _outcome(real.address, request)
        theirs = await _outcome(vllm_grpc_reference, request)
        assert ours == theirs
        tokens, chunk_tokens, completes = ours
        assert completes[-1][1:3] == ("length", len(PROMPT))
        if stream:
            assert len(tokens) == chunk_tokens == room
        else:
            *_, completion_tokens, output_ids = completes[-1]
            assert len(output_ids) == completion_tokens == room
    await wait_until(lambda: real_engine_idle(real), what="nothing left running")


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "unary"])
async def test_a_request_wrong_twice_is_told_about_its_sampling_values_first(
    real: Harness, vllm_grpc_reference: str, stream: bool
) -> None:
    """vLLM's own test_generate_error_handling: no prompt and top_p=-33 names top_p."""
    request = _request("wrong-twice", stream, None, temperature=0.0, max_tokens=10, top_p=-33)
    ours = await _outcome(real.address, request)
    theirs = await _outcome(vllm_grpc_reference, request)
    assert ours[0] == theirs[0] == "INVALID_ARGUMENT"
    assert "top_p must be in (0, 1], got -33.0" in ours[1]
    assert "top_p must be in (0, 1], got -33.0" in theirs[1]
    # Only the prompt wrong: a clear message naming the field (vLLM's server would instead
    # generate from an empty prompt's BOS token; this worker refuses it).
    empty = await _outcome(real.address, _request("empty", stream, None, max_tokens=4))
    assert empty == ("INVALID_ARGUMENT", "the prompt is empty: tokenized.input_ids has no tokens")


async def test_an_over_long_prompt_is_invalid_argument_on_both(
    real: Harness, vllm_grpc_reference: str
) -> None:
    request = _request("too-long", True, [5] * (MAX_MODEL_LEN + 4), max_tokens=4)
    ours = await _outcome(real.address, request)
    theirs = await _outcome(vllm_grpc_reference, request)
    assert ours[0] == theirs[0] == "INVALID_ARGUMENT"


async def test_server_info_says_what_vllms_server_says(
    real: Harness, vllm_grpc_reference: str
) -> None:
    """The facts a router shapes requests by, for a text model: where a grammar starts on a
    thinking prompt, the encoder dtype, this host's /dev/shm (same model and engine flags)."""
    fields = (
        "constrained_decoding_start", "engine_reasoning_parser", "multimodal_encoder_dtype",
        "shm_namespace_id",
    )  # fmt: skip
    infos = []
    for address in (real.address, vllm_grpc_reference):
        async with grpc.aio.insecure_channel(address) as channel:
            info = await vpb_grpc.VllmEngineStub(channel).GetServerInfo(vpb.GetServerInfoRequest())
        infos.append({name: getattr(info, name) for name in fields})
    ours, theirs = infos
    assert ours == theirs
    assert ours["constrained_decoding_start"] == "first_token" and ours["shm_namespace_id"]
