"""Which response fields the reference servers fill and ours leaves empty, and the reverse.

The same requests go to vLLM's own `--grpc` server (the reference on vllm.grpc.engine) and
to ours, and to vllm-rs and ours on vLLM's native contract: the same model and engine flags,
with the options that change what is filled (streamed and unary, logprobs and prompt
logprobs, n > 1, a stop string, a stop token id, text). Per response message, the fields
each side set on any answer are collected (nested fields by their dotted path, a oneof by
its branch), and the two sets compared. Every field only one side fills is listed below with
the reason; a new one (a field a release starts to fill, or one we stop filling) fails the
test and names itself.

Not covered here, and why: speculative decoding (the session's engines run none: its counts
are compared with vLLM's own in test_real_multi_token.py), prefill/decode parameters
(test_e2e_disaggregation.py pairs real workers), media (test_real_media.py), embeddings
(test_real_router_grade.py)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import grpc
import pytest
from google.protobuf.message import Message
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc

from vllm_router.proto import vllm_native_pb2 as npb
from vllm_router.proto import vllm_native_pb2_grpc as npb_grpc

from harness import Harness, real_engine_idle, wait_until

pytestmark = pytest.mark.vllm

PROMPT = [1, 45, 471, 338, 100, 7, 8]  # shorter than a KV block: never cached
# Every id but the special ones (the tiny model has 512): the first token stops the answer.
STOP_IDS = list(range(3, 512))
MAX_TOKENS = 8

# vllm.grpc.engine: (message, field) -> why only the reference fills it.
REFERENCE_ONLY: dict[tuple[str, str], str] = {
    ("GetLoadsResponse", "loads.gen_throughput"): (
        "its own front end's tokens per second over a window it keeps; vLLM's engine "
        "statistics (what ours reports from) have no such figure, and SMG routes on the "
        "queue and KV figures"
    ),
}
# vllm.grpc.engine: (message, field) -> why only ours fills it.
OURS_ONLY: dict[tuple[str, str], str] = {
    ("GetModelInfoResponse", "default_sampling_params_json"): (
        'the model\'s generation-config defaults, "{}" when there are none (the reference '
        'sends "" then); SMG parses either as no defaults'
    ),
    ("GetServerInfoResponse", "last_receive_timestamp"): "filled: the reference leaves it 0",
    ("GetServerInfoResponse", "server_type"): 'filled ("vllm-grpc"): the reference leaves it ""',
    ("GetServerInfoResponse", "uptime_seconds"): "filled: the reference leaves it 0",
}
# The native contract against vllm-rs, the same way.
NATIVE_REFERENCE_ONLY: dict[tuple[str, str], str] = {}
NATIVE_OURS_ONLY: dict[tuple[str, str], str] = {}


def filled(message: Message, prefix: str = "") -> set[str]:
    """Every field `message` sets, by dotted path (a repeated message: any element's)."""
    paths: set[str] = set()
    for field, value in message.ListFields():
        path = f"{prefix}{field.name}"
        paths.add(path)
        if field.message_type is None or field.message_type.GetOptions().map_entry:
            continue
        if field.is_repeated:
            for element in value:
                paths |= filled(element, f"{path}.")
        else:
            paths |= filled(value, f"{path}.")
    return paths


def by_message(messages: Iterable[Message], seen: dict[str, set[str]]) -> None:
    """Add what `messages` fill to `seen`, keyed by message name (a oneof's branch: its own)."""
    for message in messages:
        name = message.DESCRIPTOR.name
        for path in filled(message):
            head, _, rest = path.partition(".")
            branch = message.DESCRIPTOR.fields_by_name[head]
            if branch.containing_oneof is not None and branch.message_type is not None:
                seen.setdefault(f"{name}.{head}", set())
                if rest:
                    seen[f"{name}.{head}"].add(rest)
            else:
                seen.setdefault(name, set()).add(path)


def differences(ours: dict[str, set[str]], theirs: dict[str, set[str]]) -> tuple[set, set]:
    """(fields only the reference set, fields only ours set), as (message, field) pairs."""
    names = set(ours) | set(theirs)
    reference_only = {(n, f) for n in names for f in theirs.get(n, set()) - ours.get(n, set())}
    ours_only = {(n, f) for n in names for f in ours.get(n, set()) - theirs.get(n, set())}
    return reference_only, ours_only


def _vllm_grpc_requests() -> list[vpb.GenerateRequest]:
    variants: dict[str, dict[str, Any]] = {
        "greedy": {"temperature": 0.0},
        "logprobs": {"temperature": 0.0, "logprobs": 2, "prompt_logprobs": 2},
        "n2": {"temperature": 0.8, "seed": 3, "n": 2},
        "stop string": {"temperature": 0.0, "stop": ["e"], "max_tokens": 32},
        "stop token": {"temperature": 0.0, "stop_token_ids": STOP_IDS, "max_tokens": 32},
        "text": {"temperature": 0.0, "skip_special_tokens": True},
    }
    requests = []
    for name, sampling in variants.items():
        for stream in (True, False):
            params = {"max_tokens": MAX_TOKENS, "ignore_eos": True, **sampling}
            request = vpb.GenerateRequest(
                request_id=f"fields-{name.replace(' ', '-')}-{stream}",
                sampling_params=vpb.SamplingParams(**params),
                stream=stream,
            )
            request.tokenized.input_ids.extend(PROMPT)
            requests.append(request)
    return requests


async def _vllm_grpc_fields(address: str) -> dict[str, set[str]]:
    seen: dict[str, set[str]] = {}
    async with grpc.aio.insecure_channel(address) as channel:
        stub = vpb_grpc.VllmEngineStub(channel)
        for request in _vllm_grpc_requests():
            by_message([m async for m in stub.Generate(request)], seen)
        by_message(
            [
                await stub.GetModelInfo(vpb.GetModelInfoRequest()),
                await stub.GetServerInfo(vpb.GetServerInfoRequest()),
                await stub.HealthCheck(vpb.HealthCheckRequest()),
                await stub.GetLoads(vpb.GetLoadsRequest()),
            ],
            seen,
        )
    return seen


def _native_requests() -> list[npb.GenerateRequest]:
    variants: dict[str, dict[str, Any]] = {
        "tokens": {"response": npb.ResponseOptions(output_token_ids=True, output_text=False)},
        "text and ids": {
            "response": npb.ResponseOptions(
                output_token_ids=True, output_text=True, prompt_token_ids=True
            )
        },
        "logprobs": {
            "response": npb.ResponseOptions(
                output_token_ids=True,
                output_logprobs=True,
                prompt_logprobs=True,
                output_candidates=npb.CandidateTokens(top_n=2),
                prompt_candidates=npb.CandidateTokens(top_n=2),
            )
        },
        "stop string": {
            "response": npb.ResponseOptions(output_token_ids=True, output_text=True),
            "stopping": npb.StoppingCriteria(
                max_new_tokens=32, stop_strings=["e"], ignore_eos=True
            ),
        },
        "stop token": {
            "response": npb.ResponseOptions(output_token_ids=True),
            "stopping": npb.StoppingCriteria(max_new_tokens=32, stop_token_ids=STOP_IDS),
        },
    }
    requests = []
    for name, fields in variants.items():
        request = npb.GenerateRequest(
            request_id=f"native-fields-{name.replace(' ', '-')}",
            stopping=fields.get(
                "stopping", npb.StoppingCriteria(max_new_tokens=MAX_TOKENS, ignore_eos=True)
            ),
            response=fields["response"],
        )
        request.token_ids.ids.extend(PROMPT)
        requests.append(request)
    return requests


async def _native_fields(address: str) -> dict[str, set[str]]:
    seen: dict[str, set[str]] = {}
    async with grpc.aio.insecure_channel(address) as channel:
        inference, control = npb_grpc.InferenceStub(channel), npb_grpc.ControlStub(channel)
        for request in _native_requests():
            by_message([m async for m in inference.GenerateStream(request)], seen)
            by_message([await inference.Generate(request)], seen)
        by_message(
            [
                await control.GetServerInfo(npb.GetServerInfoRequest()),
                await control.GetModelInfo(npb.GetModelInfoRequest()),
            ],
            seen,
        )
    return seen


def _compare(
    reference: str,
    ours: dict[str, set[str]],
    theirs: dict[str, set[str]],
    known: tuple[dict[tuple[str, str], str], dict[tuple[str, str], str]],
    figures: Any,
) -> None:
    """Every field only one side filled is a known one (`known`: reference-only, ours-only),
    and each known one was seen: a report of both, with the reasons, among the figures."""
    reference_only, ours_only = differences(ours, theirs)
    rows = []
    for title, only, reasons in (
        (f"only {reference} fills", reference_only, known[0]),
        ("only ours fills", ours_only, known[1]),
    ):
        rows.append(f"{title}:")
        for message, field in sorted(only):
            reason = reasons.get((message, field), "NEW, not explained")
            rows.append(f"  {message}.{field}: {reason}")
    figures("\n".join(rows))
    assert (reference_only, ours_only) == (set(known[0]), set(known[1]))


async def test_vllm_grpc_engine_fills_what_vllms_grpc_server_fills(
    real: Harness, vllm_grpc_reference: str, figures: Any
) -> None:
    ours = await _vllm_grpc_fields(real.address)
    theirs = await _vllm_grpc_fields(vllm_grpc_reference)
    _compare("vLLM's --grpc server", ours, theirs, (REFERENCE_ONLY, OURS_ONLY), figures)
    await wait_until(lambda: real_engine_idle(real), what="nothing left running")


async def test_the_native_contract_fills_what_vllm_rs_fills(
    real: Harness, vllm_rs_reference: str, figures: Any
) -> None:
    ours = await _native_fields(real.address)
    theirs = await _native_fields(vllm_rs_reference)
    known = (NATIVE_REFERENCE_ONLY, NATIVE_OURS_ONLY)
    _compare("vllm-rs", ours, theirs, known, figures)
    await wait_until(lambda: real_engine_idle(real), what="nothing left running")
