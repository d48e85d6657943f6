"""OpenAI requests through the vllm-project's own router (`vllm-router`, gRPC backend) to this
servicer's native contract, against the same router in front of vLLM's Rust front end
(`vllm-rs --grpc-port`, the reference on vllm.Inference), same model and engine flags: the
router's answers must be identical."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import jsonschema
import pytest

from harness import Harness, real_engine_idle, wait_until
from real_engine import MAX_MODEL_LEN
from routers import CHAT, COMPLETIONS, ask, chat, drop_mid_stream

pytestmark = pytest.mark.vllm

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome"]},
        "days": {"type": "integer"},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
# ebnf (xgrammar's GBNF-style syntax), as the router forwards it.
GRAMMAR = 'root ::= ("yes" | "no") " " [a-z]{2,6}'


def cases(prompt_ids: list[int]) -> dict[str, tuple[str, dict, bool]]:
    """name -> (path, body, streamed?). The router takes completions' prompts as token ids."""

    def completion(**fields: object) -> dict:
        return {"prompt": prompt_ids, **fields}

    return {
        "chat greedy": (CHAT, chat("Hello worker", max_tokens=24, temperature=0), False),
        "chat greedy streamed": (CHAT, chat("Hello worker", max_tokens=24, temperature=0), True),
        "completions greedy": (COMPLETIONS, completion(max_tokens=24, temperature=0), False),
        "completions streamed": (COMPLETIONS, completion(max_tokens=24, temperature=0), True),
        "chat seeded": (CHAT, chat("Tell me", max_tokens=24, temperature=0.8, seed=5), False),
        "completions seeded streamed": (
            COMPLETIONS, completion(max_tokens=24, temperature=0.9, seed=6, top_p=0.9, top_k=20),
            True),
        "chat penalties": (CHAT, chat("Again and again", max_tokens=24, temperature=0.7, seed=3,
                                      presence_penalty=0.6, frequency_penalty=0.4,
                                      repetition_penalty=1.3), False),
        "chat logit bias": (CHAT, chat("Bias", max_tokens=12, temperature=0,
                                       logit_bias={str(prompt_ids[0]): 100}), False),
        "chat stop string": (CHAT, chat("Hello worker", max_tokens=40, temperature=0,
                                        stop=["e"]), False),
        "chat stop string streamed": (CHAT, chat("Hello worker", max_tokens=40, temperature=0,
                                                 stop=["e"]), True),
        "chat stop token id": (CHAT, chat("Hello worker", max_tokens=40, temperature=0,
                                          stop_token_ids=[prompt_ids[-1]]), False),
        "completions min tokens": (COMPLETIONS, completion(max_tokens=12, min_tokens=12,
                                                           temperature=0), False),
        "chat max_tokens 1": (CHAT, chat("One", max_tokens=1, temperature=0), False),
        # No max: the router sends 0, generated until the context is full (or EOS).
        "chat no max": (CHAT, chat("Hello worker", temperature=0, ignore_eos=True), False),
        "completions no max streamed": (COMPLETIONS, completion(temperature=0, ignore_eos=True),
                                        True),
        "chat json schema": (CHAT, chat("Plan a trip", max_tokens=60, temperature=0,
                                        response_format={"type": "json_schema", "json_schema":
                                                         {"name": "trip", "schema": SCHEMA}}),
                             False),
        "chat json_object": (CHAT, chat("Any JSON", max_tokens=40, temperature=0,
                                        response_format={"type": "json_object"}), False),
        "chat regex": (CHAT, chat("Digits", max_tokens=20, temperature=0,
                                  structured_outputs={"regex": "[0-9]{3}-[a-z]{2}"}), False),
        "chat grammar": (CHAT, chat("Yes or no", max_tokens=20, temperature=0,
                                    structured_outputs={"grammar": GRAMMAR}), False),
        "prompt over the context window": (CHAT, chat("word " * 400, max_tokens=8), False),
        "an unknown model": (CHAT, {**chat("Hi", max_tokens=4), "model": "no-such-model"},
                             False),
    }  # fmt: skip


async def test_vllm_router_answers_are_identical_through_ours_and_vllm_rs(
    real: Harness, vllm_router_ours: str, vllm_router_reference: str, figures
) -> None:
    model = str(real.model_dir)
    prompt_ids = await real.engine.tokenize("The router")
    mismatches, matched, answers = [], [], {}
    for name, (path, body, streamed) in cases(prompt_ids).items():
        body = {"model": model, **body}
        ours = answers[name] = await ask(vllm_router_ours, path, body, streamed)
        theirs = await ask(vllm_router_reference, path, body, streamed)
        if ours != theirs:
            mismatches.append(f"{name}:\n  ours   {ours}\n  theirs {theirs}")
        else:
            matched.append(name)
    assert not mismatches, "\n".join(mismatches)
    for name, answer in answers.items():
        if name in ("prompt over the context window", "an unknown model"):
            assert answer[0] in (400, 404), (name, answer)
        elif isinstance(answer[0], int):
            assert answer[0] == 200 and answer[1], (name, answer)  # a real answer, not an error
        else:
            assert answer[0] and all(text for _, text in answer[0]), (name, answer)
    _, choices, _ = answers["chat json schema"]
    if choices[0][3] == "stop":
        jsonschema.validate(json.loads(choices[0][1]), SCHEMA)
    _, choices, (prompt_tokens, completion_tokens) = answers["chat no max"]
    assert choices[0][3] == "length" and prompt_tokens + completion_tokens == MAX_MODEL_LEN
    assert answers["completions min tokens"][2][1] == 12
    figures(f"{len(matched)} OpenAI cases identical through vllm-router to ours and to vllm-rs")


async def test_client_disconnect_through_vllm_router_leaves_nothing_running(
    real: Harness, vllm_router_ours: str, figures: Callable[[str], None]
) -> None:
    await wait_until(lambda: real_engine_idle(real), 10.0, "the engine to be idle")
    body = {"model": str(real.model_dir), "stream": True, "ignore_eos": True,
            **chat("Keep going", max_tokens=200, temperature=0)}  # fmt: skip

    dropped = await drop_mid_stream(vllm_router_ours, body, real)
    figures(
        f"client hung up after 4 lines: the worker generated {dropped.generated} of 200 tokens "
        f"({dropped.at_hang_up} before the hang-up)"
    )
    await wait_until(lambda: real_engine_idle(real), 10.0, "the engine to abort the request")
    # The router answers its client before it closes its stream to the worker: the table
    # entry goes when that stream does, a moment after the engine is idle.
    await wait_until(lambda: not real.server.requests.in_flight, 5.0, "the table to be empty")


async def test_both_rust_routers_on_one_worker_at_once(
    real: Harness, router_ours: str, vllm_router_ours: str
) -> None:
    """The SMG router (vllm.grpc.engine) and vllm-router (vllm.Inference) drive the same worker
    at the same time: one engine, one request table, every answer as when each runs alone."""
    model = str(real.model_dir)
    bodies = [{"model": model, **chat(f"Both at once {i}", max_tokens=12, temperature=0)}
              for i in range(8)]  # fmt: skip
    alone = [await ask(vllm_router_ours, CHAT, body, False) for body in bodies]
    alone_smg = [await ask(router_ours, CHAT, body, False) for body in bodies]

    def text(answer: tuple) -> tuple:  # the routers write an empty answer as "" or null
        return [(c[0], c[1] or "", c[3]) for c in answer[1]], answer[2]

    assert [text(a) for a in alone] == [text(a) for a in alone_smg]  # one engine, same tokens
    together = await asyncio.gather(
        *(ask(base, CHAT, body, streamed)
          for body in bodies for base in (router_ours, vllm_router_ours)
          for streamed in (False, True))
    )  # fmt: skip
    unary = together[0::2]
    assert [text(a) for a in unary] == [text(a) for a in alone for _ in range(2)]
    for answer, streamed in zip(unary, together[1::2], strict=True):
        assert streamed[0] == [(0, answer[1][0][1] or "")]
        assert streamed[1] == [(0, answer[1][0][3])]
    await wait_until(lambda: real_engine_idle(real), 10.0, "the engine to be idle")
    await wait_until(lambda: not real.server.requests.in_flight, 5.0, "the table to be empty")
