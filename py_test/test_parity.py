"""Token-for-token parity with vLLM's own OpenAI server on the same model and engine flags.

Both servers run the tiny model with the same flags and seed; each case is sent
to vLLM's `/v1/completions` (token-id prompt, `return_token_ids`) and to our
`Generate`, sequentially so both engines see the same batches.
"""

from __future__ import annotations

import asyncio
from typing import cast

import pytest

from vllm_router.proto import vllm_engine_pb2 as pb

from harness import Harness, request
from real_engine import MAX_MODEL_LEN
from vllm_servers import post

pytestmark = pytest.mark.vllm

EOS_PROMPT_SEARCH = range(3, 60)
LONG = [(i * 13) % 500 + 3 for i in range(MAX_MODEL_LEN - 6)]

# name -> (prompt, sampling fields). Prompts "EOS" are replaced by one whose greedy
# continuation ends in EOS; stop ids "REF[i]" by the i-th token of the greedy reference.
CASES: dict[str, tuple[object, dict[str, object]]] = {
    "greedy": ([10, 20, 30, 40], {"temperature": 0.0, "max_tokens": 16}),
    "greedy one-token prompt": ([5], {"temperature": 0.0, "max_tokens": 32}),
    "max_tokens 1": ([10, 20, 30, 40], {"temperature": 0.0, "max_tokens": 1}),
    "max_tokens large": ([9, 8, 7], {"temperature": 0.0, "max_tokens": 200, "ignore_eos": True}),
    "near the context limit": (LONG, {"temperature": 0.0, "max_tokens": 6}),
    "last free position": (LONG + [4] * 5, {"temperature": 0.0, "max_tokens": 1}),
    "seeded temperature": ([7, 8, 9], {"temperature": 0.8, "seed": 1, "max_tokens": 40}),
    "seeded top_p": ([7, 8, 9], {"temperature": 1.0, "top_p": 0.9, "seed": 2, "max_tokens": 40}),
    "seeded top_k": ([7, 8, 9], {"temperature": 0.7, "top_k": 20, "seed": 3, "max_tokens": 40}),
    "seeded min_p": ([7, 8, 9], {"temperature": 1.0, "min_p": 0.1, "seed": 4, "max_tokens": 40}),
    "seeded all filters": (
        [11, 12],
        {"temperature": 1.2, "top_p": 0.8, "top_k": 40, "min_p": 0.05, "seed": 5, "max_tokens": 40},
    ),
    "unset temperature seeded": ([3, 4], {"seed": 6, "max_tokens": 30}),
    "frequency penalty": (
        [10, 20],
        {"temperature": 0.0, "frequency_penalty": 1.0, "max_tokens": 40},
    ),
    "presence penalty": ([10, 20], {"temperature": 0.0, "presence_penalty": 1.5, "max_tokens": 40}),
    "repetition penalty": (
        [10, 20],
        {"temperature": 0.0, "repetition_penalty": 1.3, "max_tokens": 40},
    ),
    "penalties while sampling": (
        [10, 20],
        {
            "temperature": 0.9,
            "seed": 7,
            "frequency_penalty": 0.5,
            "presence_penalty": -0.5,
            "repetition_penalty": 0.9,
            "max_tokens": 40,
        },
    ),
    "stop string": ([10, 20, 30, 40], {"temperature": 0.0, "max_tokens": 40, "stop": ["e"]}),
    "stop strings kept": (
        [10, 20, 30, 40],
        {
            "temperature": 0.0,
            "max_tokens": 40,
            "stop": ["s", "t"],
            "include_stop_str_in_output": True,
        },
    ),
    "stop token id": (
        [10, 20, 30, 40],
        {"temperature": 0.0, "max_tokens": 40, "stop_token_ids": "REF[4]"},
    ),
    "eos": ("EOS", {"temperature": 0.0, "max_tokens": 48}),
    "eos ignored": ("EOS", {"temperature": 0.0, "max_tokens": 48, "ignore_eos": True}),
    "min_tokens past eos": ("EOS", {"temperature": 0.0, "max_tokens": 48, "min_tokens": 30}),
    "special tokens kept in text": (
        "EOS",
        {"temperature": 0.0, "max_tokens": 48, "ignore_eos": True, "skip_special_tokens": False},
    ),
    "greedy logprobs": ([10, 20, 30], {"temperature": 0.0, "max_tokens": 12, "logprobs": 0}),
    "sampled top-5 logprobs": (
        [10, 20, 30],
        {"temperature": 1.0, "seed": 8, "max_tokens": 12, "logprobs": 5},
    ),
}


async def _resolve(real: Harness, prompt: object, sampling: dict) -> tuple[list[int], dict]:
    sampling = dict(sampling)
    if prompt == "EOS":
        for start in EOS_PROMPT_SEARCH:
            candidate = [start, start + 1, start + 2]
            probe = await real.stub.Generate(request(candidate, temperature=0.0, max_tokens=20))
            if probe.finish_reason == "stop":
                prompt = candidate
                break
        else:
            raise AssertionError("no EOS prompt found")
    if isinstance(sampling.get("stop_token_ids"), str):
        index = int(sampling["stop_token_ids"][4:-1])
        reference = await real.stub.Generate(
            request(cast("list[int]", prompt), temperature=0.0, max_tokens=index + 1)
        )
        sampling["stop_token_ids"] = [reference.output_token_ids[index]]
    return list(cast("list[int]", prompt)), sampling


async def test_parity_with_vllm_openai_server(real: Harness, vllm_http: str) -> None:
    model = str(real.model_dir)
    mismatches = []
    finish_reasons = set()
    for name, (raw_prompt, raw_sampling) in CASES.items():
        prompt, sampling = await _resolve(real, raw_prompt, raw_sampling)
        ours = await real.stub.Generate(request(prompt, **sampling))
        body = {
            "model": model,
            "prompt": prompt,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            **sampling,
        }
        theirs = (await asyncio.to_thread(post, vllm_http + "/v1/completions", body))["choices"][0]
        finish_reasons.add(theirs["finish_reason"])
        problems = [] if theirs["token_ids"] else ["vLLM returned no token ids"]
        if list(ours.output_token_ids) != theirs["token_ids"]:
            problems.append(f"tokens {list(ours.output_token_ids)} != {theirs['token_ids']}")
        if ours.output_text != theirs["text"]:
            problems.append(f"text {ours.output_text!r} != {theirs['text']!r}")
        if ours.finish_reason != theirs["finish_reason"]:
            problems.append(f"finish {ours.finish_reason} != {theirs['finish_reason']}")
        ours_stop = getattr(ours, ours.WhichOneof("matched_stop") or "request_id", None)
        if theirs.get("stop_reason") is not None and ours_stop != theirs["stop_reason"]:
            problems.append(f"stop {ours_stop!r} != {theirs['stop_reason']!r}")
        if "logprobs" in sampling:
            if not 0 < len(ours.logprobs) == len(ours.output_token_ids):
                problems.append(f"{len(ours.logprobs)} logprobs for {len(ours.output_token_ids)}")
            problems += _logprob_problems(ours, theirs["logprobs"], sampling["logprobs"])
        if problems:
            mismatches.append(f"{name}: " + "; ".join(problems))
    assert not mismatches, "\n".join(mismatches)
    assert finish_reasons == {"stop", "length"}  # both ways of ending were compared


def _logprob_problems(ours: pb.GenerateResponse, theirs: dict, k: int) -> list[str]:
    problems = []
    if len(ours.logprobs) != len(theirs["token_logprobs"]):
        return [f"logprob count {len(ours.logprobs)} != {len(theirs['token_logprobs'])}"]
    for i, (mine, value) in enumerate(zip(ours.logprobs, theirs["token_logprobs"], strict=True)):
        if abs(mine.logprob - value) > 1e-4:
            problems.append(f"logprob[{i}] {mine.logprob} != {value}")
        their_top = {
            int(t.split(":")[1]): lp for t, lp in (theirs["top_logprobs"][i] or {}).items()
        }
        our_top = {t.token_id: t.logprob for t in mine.top_logprobs}
        # vLLM's OpenAI top_logprobs also list the sampled token when it is outside the top k.
        their_top_k = dict(sorted(their_top.items(), key=lambda kv: -kv[1])[:k]) if k else {}
        if set(our_top) != set(their_top_k) or any(
            abs(our_top[t] - their_top_k[t]) > 1e-4 for t in our_top
        ):
            problems.append(f"top_logprobs[{i}] {our_top} != {their_top_k}")
    return problems
