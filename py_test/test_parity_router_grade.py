"""Router-grade fields, token for token against vLLM's own OpenAI server (same model, flags).

Structured outputs, n, logit_bias, allowed_token_ids, bad_words, prompt_logprobs, a LoRA
adapter and priorities: each case goes to our `Generate` and to vLLM's `/v1/completions`,
sequentially, and every sample's token ids, text, finish reason and logprobs must match.
"""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

import grpc
import jsonschema
import pytest

from vllm_router.proto import vllm_engine_pb2 as pb

from harness import Harness, request
from real_engine import LORA_NAME, tiny_lora
from vllm_servers import VllmHttpError, post

pytestmark = pytest.mark.vllm

SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"type": "string", "enum": ["red", "green", "blue"]},
        "count": {"type": "integer"},
    },
    "required": ["color", "count"],
    "additionalProperties": False,
}
SCHEMA_TEXT = json.dumps(SCHEMA)
STRUCTURAL_TAG = {
    "type": "structural_tag",
    "structures": [{"begin": "<n>", "schema": {"type": "integer"}, "end": "</n>"}],
    "triggers": ["<n>"],
}
GREEDY: dict[str, Any] = {"temperature": 0.0}
P = [10, 20, 30, 40]

# name -> (prompt, sampling, structured outputs (vLLM's field names), request extras)
CASES: dict[str, tuple[list[int], dict[str, Any], dict[str, Any] | None, dict[str, Any]]] = {
    "json schema": (P, {**GREEDY, "max_tokens": 60}, {"json": SCHEMA_TEXT}, {}),
    "json schema, no whitespace": (
        P,
        {**GREEDY, "max_tokens": 60},
        {"json": SCHEMA_TEXT, "disable_any_whitespace": True},
        {},
    ),
    "json schema seeded": (
        [7, 8],
        {"temperature": 0.8, "seed": 3, "max_tokens": 60},
        {"json": SCHEMA_TEXT},
        {},
    ),
    "json_object": (P, {**GREEDY, "max_tokens": 40}, {"json_object": True}, {}),
    "regex": (P, {**GREEDY, "max_tokens": 20}, {"regex": "[a-z]{3,8}-[0-9]{2}"}, {}),
    "regex seeded": (
        [5, 6],
        {"temperature": 1.0, "seed": 4, "max_tokens": 20},
        {"regex": "(yes|no), [A-Z][a-z]+"},
        {},
    ),
    "choice": (P, {**GREEDY, "max_tokens": 10}, {"choice": ["red", "green", "blue"]}, {}),
    "choice seeded": (
        [9, 9],
        {"temperature": 1.0, "seed": 5, "max_tokens": 10},
        {"choice": ["alpha", "beta", "gamma delta"]},
        {},
    ),
    "grammar": (
        P,
        {**GREEDY, "max_tokens": 20},
        {"grammar": 'root ::= ("cat" | "dog") " " [0-9] [0-9]'},
        {},
    ),
    "structural_tag": (
        P,
        {**GREEDY, "max_tokens": 30},
        {"structural_tag": json.dumps(STRUCTURAL_TAG)},
        {},
    ),
    "n=3 seeded": ([7, 8, 9], {"temperature": 0.9, "seed": 11, "n": 3, "max_tokens": 20}, None, {}),
    # vLLM refuses n > 1 with greedy sampling: both servers must refuse it alike.
    "n=2 greedy (refused)": (P, {**GREEDY, "n": 2, "max_tokens": 12}, None, {}),
    "n=2 seeded with logprobs": (
        [3, 4],
        {"temperature": 1.0, "seed": 12, "n": 2, "max_tokens": 10, "logprobs": 2},
        None,
        {},
    ),
    "logit_bias forces a token": (
        P,
        {**GREEDY, "max_tokens": 8, "logit_bias": {77: 100.0}},
        None,
        {},
    ),
    "logit_bias bans the greedy token": (
        P,
        {**GREEDY, "max_tokens": 8, "logit_bias": "BAN"},
        None,
        {},
    ),
    "logit_bias mixed, seeded": (
        [7, 8],
        {
            "temperature": 1.0,
            "seed": 6,
            "max_tokens": 16,
            "logit_bias": {5: 4.0, 6: -4.0, 300: 2.5},
        },
        None,
        {},
    ),
    "allowed_token_ids": (
        P,
        {**GREEDY, "max_tokens": 10, "allowed_token_ids": [10, 11, 12, 50, 60, 70]},
        None,
        {},
    ),
    "allowed_token_ids seeded": (
        [7, 8],
        {"temperature": 1.0, "seed": 7, "max_tokens": 10, "allowed_token_ids": [3, 4, 5, 6, 7]},
        None,
        {},
    ),
    "bad_words": (P, {**GREEDY, "max_tokens": 30, "bad_words": "WORD"}, None, {}),
    "prompt_logprobs=2": (P, {**GREEDY, "max_tokens": 4, "prompt_logprobs": 2}, None, {}),
    "prompt_logprobs=0": (
        [5, 6, 7, 8, 9],
        {**GREEDY, "max_tokens": 2, "prompt_logprobs": 0},
        None,
        {},
    ),
    "lora greedy": (P, {**GREEDY, "max_tokens": 16}, None, {"lora_name": LORA_NAME}),
    "lora seeded": (
        [7, 8],
        {"temperature": 0.9, "seed": 8, "max_tokens": 16},
        None,
        {"lora_name": LORA_NAME},
    ),
    "lora n=2 seeded": (
        [7, 8],
        {"temperature": 0.9, "seed": 9, "n": 2, "max_tokens": 8},
        None,
        {"lora_name": LORA_NAME},
    ),
    "priority 5": (P, {**GREEDY, "max_tokens": 12}, None, {"priority": 5}),
    "priority -3 seeded": (
        [3, 4],
        {"temperature": 0.7, "seed": 10, "max_tokens": 12},
        None,
        {"priority": -3},
    ),
}


async def ensure_lora(real: Harness) -> None:
    """Load the tiny adapter into our server through the RPC (once per session)."""
    listed = await real.stub.ListLoraAdapters(pb.ListLoraAdaptersRequest())
    if LORA_NAME not in [a.name for a in listed.adapters]:
        await real.stub.LoadLoraAdapter(
            pb.LoadLoraAdapterRequest(name=LORA_NAME, path=str(tiny_lora()))
        )


def _ours(prompt: list[int], sampling: dict, so: dict | None, extras: dict) -> pb.GenerateRequest:
    fields = dict(sampling)
    if so is not None:
        so = dict(so)
        if "choice" in so:
            so["choice"] = pb.ChoiceList(choices=so["choice"])
        fields["structured_outputs"] = pb.StructuredOutputs(**so)
    message = request(prompt, **fields)
    for name, value in extras.items():
        setattr(message, name, value)
    return message


def _theirs(model: str, prompt: list[int], sampling: dict, so: dict | None, extras: dict) -> dict:
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
        **sampling,
    }
    if "logit_bias" in body:
        body["logit_bias"] = {str(k): v for k, v in body["logit_bias"].items()}
    if so is not None:
        body["structured_outputs"] = so
    if "lora_name" in extras:
        body["model"] = extras["lora_name"]
    if "priority" in extras:
        body["priority"] = extras["priority"]
    return body


def _samples(ours: pb.GenerateResponse) -> list[Any]:
    return list(ours.samples) if len(ours.samples) else [ours]


def _compare(ours: pb.GenerateResponse, theirs: dict, sampling: dict) -> list[str]:
    problems = []
    choices = sorted(theirs["choices"], key=lambda c: c["index"])
    mine = _samples(ours)
    if len(mine) != len(choices):
        return [f"{len(mine)} samples != {len(choices)} choices"]
    for i, (sample, choice) in enumerate(zip(mine, choices, strict=True)):
        if list(sample.output_token_ids) != choice["token_ids"]:
            problems.append(
                f"[{i}] tokens {list(sample.output_token_ids)} != {choice['token_ids']}"
            )
        if sample.output_text != choice["text"]:
            problems.append(f"[{i}] text {sample.output_text!r} != {choice['text']!r}")
        if sample.finish_reason != choice["finish_reason"]:
            problems.append(f"[{i}] finish {sample.finish_reason} != {choice['finish_reason']}")
        if "logprobs" in sampling:
            values = choice["logprobs"]["token_logprobs"]
            got = [e.logprob for e in sample.logprobs]
            if len(got) != len(values) or any(
                abs(a - b) > 1e-4 for a, b in zip(got, values, strict=True)
            ):
                problems.append(f"[{i}] logprobs {got} != {values}")
    if "prompt_logprobs" in sampling:
        problems += _prompt_logprob_problems(ours, choices[0]["prompt_logprobs"], sampling)
    return problems


def _prompt_logprob_problems(ours: pb.GenerateResponse, theirs: list, sampling: dict) -> list[str]:
    k = sampling["prompt_logprobs"]
    if len(ours.prompt_logprobs) != len(theirs):
        return [f"prompt logprob count {len(ours.prompt_logprobs)} != {len(theirs)}"]
    first = ours.prompt_logprobs[0]
    problems = [] if theirs[0] is None and math.isnan(first.logprob) else ["first entry"]
    for i, (entry, position) in enumerate(zip(ours.prompt_logprobs[1:], theirs[1:], strict=True)):
        value = position[str(entry.token_id)]["logprob"]
        top = {int(t): v["logprob"] for t, v in position.items() if v["rank"] <= k}
        our_top = {t.token_id: t.logprob for t in entry.top_logprobs}
        if abs(entry.logprob - value) > 1e-4 or set(our_top) != set(top):
            problems.append(f"prompt logprob [{i + 1}] {entry.logprob}/{our_top} != {value}/{top}")
    return problems


async def _refused_alike(
    real: Harness, ours: pb.GenerateRequest, vllm_http: str, body: dict
) -> list[str]:
    """Both refuse: ours INVALID_ARGUMENT, vLLM's HTTP 400, with the same message."""
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await real.stub.Generate(ours)
    with pytest.raises(VllmHttpError) as http:
        await asyncio.to_thread(post, vllm_http + "/v1/completions", body)
    their_message = json.loads(http.value.body)["error"]["message"]
    problems = []
    if err.value.code() != grpc.StatusCode.INVALID_ARGUMENT or http.value.status != 400:
        problems.append(f"codes {err.value.code()} / HTTP {http.value.status}")
    if err.value.details() not in their_message:
        problems.append(f"message {err.value.details()!r} not in {their_message!r}")
    return problems


async def test_router_grade_parity_with_vllm_openai_server(
    real: Harness, vllm_http: str, figures
) -> None:
    await ensure_lora(real)
    greedy = await real.stub.Generate(request(P, **GREEDY, max_tokens=30))
    # A word the unconstrained greedy output contains, so banning it must change the output.
    bad_word = next(w for w in greedy.output_text.split() if len(w) >= 2 and w.isalpha())
    matched: list[str] = []
    finished_json = 0
    mismatches: list[str] = []
    for name, (prompt, sampling, so, extras) in CASES.items():
        if sampling.get("logit_bias") == "BAN":
            sampling = {**sampling, "logit_bias": {greedy.output_token_ids[0]: -100.0}}
        if sampling.get("bad_words") == "WORD":
            sampling = {**sampling, "bad_words": [bad_word]}
        body = _theirs(str(real.model_dir), prompt, sampling, so, extras)
        if name.endswith("(refused)"):
            problems = await _refused_alike(
                real, _ours(prompt, sampling, so, extras), vllm_http, body
            )
            (matched if not problems else mismatches).append(f"{name}: " + "; ".join(problems))
            continue
        ours = await real.stub.Generate(_ours(prompt, sampling, so, extras))
        theirs = await asyncio.to_thread(post, vllm_http + "/v1/completions", body)
        problems = _compare(ours, theirs, sampling)
        if name in ("bad_words", "logit_bias bans the greedy token"):
            # The constraint bit: the output is not the unconstrained greedy one.
            assert ours.output_token_ids != greedy.output_token_ids, name
        if so is not None and "json" in so:
            for sample in _samples(ours):
                if sample.finish_reason == "stop":
                    jsonschema.validate(json.loads(sample.output_text), SCHEMA)
                    finished_json += 1
        if problems:
            mismatches.append(f"{name}: " + "; ".join(problems))
        else:
            matched.append(name)
    assert not mismatches, "\n".join(mismatches)
    figures(
        f"{len(matched)} router-grade cases identical to vLLM's server; "
        f"{finished_json} finished JSON outputs validated against the schema"
    )
