"""A request wrong twice is told what vllm-rs tells it: every pair of the faults the fuzzers
combine (test_native_fuzz.py; the sequences, the LoRA, the model, the prompt, sampling
ranges, stop strings, logprobs, the rank metadata, ...) sent to this worker and to vllm-rs
(the session's reference: same model, same engine flags), the status codes compared."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import pytest
from test_real_weight_transfer import PROMPT, greedy

from vllm_router.proto import vllm_native_pb2 as npb
from vllm_router.proto import vllm_native_pb2_grpc as npb_grpc

from harness import Harness

pytestmark = pytest.mark.vllm

Metadata = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Fault:
    name: str
    # Faults of one group write the same field: not combined.
    group: str
    apply: Callable[[npb.GenerateRequest], None]
    metadata: Metadata = ()


def _set(**fields: object) -> Callable[[npb.GenerateRequest], None]:
    def apply(request: npb.GenerateRequest) -> None:
        for path, value in fields.items():
            *parts, name = path.split("__")
            target = request
            for part in parts:
                target = getattr(target, part)
            if isinstance(value, list):
                getattr(target, name).extend(value)
            else:
                setattr(target, name, value)

    return apply


def _prompt(ids: list[int] | None) -> Callable[[npb.GenerateRequest], None]:
    def apply(request: npb.GenerateRequest) -> None:
        request.ClearField("token_ids")
        if ids is not None:
            request.token_ids.ids.extend(ids)

    return apply


def _media(request: npb.GenerateRequest) -> None:
    request.media.append(npb.MediaItem(data_uri="data:image/png;base64,iVBORw0KGgo="))


FAULTS = (
    Fault("sequences", "sequences", _set(sampling__num_sequences=2)),
    Fault("model", "model", _set(model="other")),
    Fault("no prompt", "prompt", _prompt(None)),
    Fault("prompt out of vocabulary", "prompt", _prompt([5, 100_000])),
    Fault("prompt too long", "prompt", _prompt([5] * 300)),
    Fault("unknown LoRA", "lora", _set(lora_name="no-such-adapter")),
    Fault("temperature", "temperature", _set(temperature=5.0)),
    Fault("top_p", "top_p", _set(sampling__top_p=1.5)),
    Fault("presence penalty", "penalty", _set(decoding__presence_penalty=5.0)),
    Fault("min over max", "length", _set(stopping__min_new_tokens=9, stopping__max_new_tokens=4)),
    Fault("empty stop string", "stop", _set(stopping__stop_strings=[""])),
    Fault("stop id out of vocabulary", "stop ids", _set(stopping__stop_token_ids=[100_000])),
    Fault("thinking budget", "budget", _set(stopping__thinking_token_budget=-2)),
    Fault("truncation", "truncation", _set(truncate_prompt_tokens=1000)),
    Fault("cache salt", "salt", _set(kv__cache_salt="a/b")),
    Fault("logprobs", "logprobs", lambda r: (
        r.response.MergeFrom(npb.ResponseOptions(output_logprobs=True,
                                                 output_candidates=npb.CandidateTokens(top_n=50))))),
    Fault("media on a text model", "media", _media),
    Fault("rank malformed", "rank", _set(), (("x-data-parallel-rank", "x"),)),
    Fault("rank not served", "rank", _set(), (("x-data-parallel-rank", "5"),)),
)  # fmt: skip


def _request(faults: tuple[Fault, ...]) -> tuple[npb.GenerateRequest, Metadata]:
    request = npb.GenerateRequest(
        token_ids=npb.TokenIds(ids=[5, 6, 7]),
        temperature=0.0,
        stopping=npb.StoppingCriteria(max_new_tokens=4),
        response=npb.ResponseOptions(output_token_ids=True, output_text=False),
    )
    metadata: Metadata = ()
    for fault in faults:
        fault.apply(request)
        metadata += fault.metadata
    return request, metadata


async def _status(channel: grpc.aio.Channel, request: npb.GenerateRequest, md: Metadata) -> str:
    try:
        async for _ in npb_grpc.InferenceStub(channel).GenerateStream(request, metadata=md):
            pass
    except grpc.aio.AioRpcError as err:
        return err.code().name
    return "OK"


def _cases() -> list[tuple[Fault, ...]]:
    singles: list[tuple[Fault, ...]] = [(f,) for f in FAULTS if f.name != "sequences"]  # served
    pairs = [
        (a, b) for a, b in itertools.combinations(FAULTS, 2) if a.group != b.group
    ]  # fmt: skip
    return singles + pairs


async def test_every_pair_of_faults_is_refused_as_vllm_rs_refuses_it(
    real: Harness, vllm_rs_reference: str
) -> None:
    cases = _cases()
    differ = []
    async with grpc.aio.insecure_channel(vllm_rs_reference) as reference:
        for faults in cases:
            request, metadata = _request(faults)
            ours = await _status(real.channel, request, metadata)
            theirs = await _status(reference, request, metadata)
            if ours != theirs or theirs == "OK":
                names = " + ".join(f.name for f in faults)
                differ.append(f"{names}: ours {ours}, vllm-rs {theirs}")
    assert not differ, f"{len(differ)} of {len(cases)}:\n" + "\n".join(differ)


async def test_budget_and_gate_without_a_reasoning_configuration(
    real: Harness, vllm_rs_reference: str
) -> None:
    """Taken, without effect, as by vllm-rs (vLLM's Python front end would refuse them)."""
    gate = npb.ReasoningGate(reasoning_ended=True)
    gate.chat_template_kwargs.update({"enable_thinking": False})
    plain = await greedy(real.channel)
    async with grpc.aio.insecure_channel(vllm_rs_reference) as channel:
        for budget in (0, 3):
            assert await greedy(real.channel, budget=budget) == plain
            assert await greedy(channel, budget=budget) == plain
        for address_channel in (real.channel, channel):
            request = npb.GenerateRequest(
                token_ids=npb.TokenIds(ids=PROMPT),
                temperature=0.0,
                stopping=npb.StoppingCriteria(max_new_tokens=12, ignore_eos=True),
                response=npb.ResponseOptions(output_token_ids=True, output_text=False),
                engine_reasoning_gate=gate,
            )
            answer = await npb_grpc.InferenceStub(address_channel).Generate(request)
            assert list(answer.outputs.token_ids) == plain
