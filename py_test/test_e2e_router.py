"""OpenAI requests through the real Rust router (SMG) to this servicer, against the same
router in front of vLLM's own `--grpc` server (same model, same engine flags): the router's
answers must be identical, token for token."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import jsonschema
import pytest

from vllm_router.proto import vllm_engine_pb2 as pb

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
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                "required": ["city"],
            },
        },
    }
]


# name -> (path, body, streamed?)
CASES: dict[str, tuple[str, dict, bool]] = {
    "chat greedy": (CHAT, chat("Hello worker", max_tokens=24, temperature=0), False),
    "chat greedy streamed": (CHAT, chat("Hello worker", max_tokens=24, temperature=0), True),
    "completions greedy": (COMPLETIONS, {"prompt": "The router", "max_tokens": 24,
                                         "temperature": 0}, False),
    "completions streamed": (COMPLETIONS, {"prompt": "The router", "max_tokens": 24,
                                           "temperature": 0}, True),
    "chat seeded": (CHAT, chat("Tell me", max_tokens=24, temperature=0.8, seed=5), False),
    "completions seeded": (COMPLETIONS, {"prompt": "Each step", "max_tokens": 24,
                                         "temperature": 0.9, "seed": 6}, False),
    "chat n=2 seeded": (CHAT, chat("Two ways", max_tokens=16, temperature=0.9, seed=7, n=2),
                        False),
    "chat n=2 seeded streamed": (CHAT, chat("Two ways", max_tokens=16, temperature=0.9,
                                             seed=7, n=2), True),
    "chat logprobs": (CHAT, chat("Scores", max_tokens=8, temperature=0, logprobs=True,
                                  top_logprobs=3), False),
    "completions logprobs": (COMPLETIONS, {"prompt": "Scores", "max_tokens": 8,
                                           "temperature": 0, "logprobs": 2}, False),
    "chat stop string": (CHAT, chat("Hello worker", max_tokens=40, temperature=0,
                                     stop=["e"]), False),
    "chat max_tokens 1": (CHAT, chat("One", max_tokens=1, temperature=0), False),
    "chat json schema": (CHAT, chat("Plan a trip", max_tokens=60, temperature=0,
                                     response_format={"type": "json_schema", "json_schema":
                                                      {"name": "trip", "schema": SCHEMA}}), False),
    "chat json_object": (CHAT, chat("Any JSON", max_tokens=40, temperature=0,
                                     response_format={"type": "json_object"}), False),
    "chat tools required": (CHAT, chat("Weather in Paris?", max_tokens=160, temperature=0,
                                        tools=TOOLS, tool_choice="required"), False),
    "prompt over the context window": (CHAT, chat("word " * 400, max_tokens=8), False),
    # OpenAI clients send a fixed large max_tokens: generated until the context is full.
    "chat max_tokens past the context": (CHAT, chat("Hello worker", max_tokens=2048,
                                                     temperature=0, ignore_eos=True), False),
    "chat max_tokens past the context streamed with stop": (
        CHAT, chat("Hello worker", max_tokens=2048, temperature=0, stop=["zq"]), True),
    "completions max_tokens past the context": (COMPLETIONS, {"prompt": "The router",
                                                              "max_tokens": 2048,
                                                              "temperature": 0,
                                                              "ignore_eos": True}, False),
    # Tool calling with sampling, seeded so both workers must give the same outcome.
    "chat tools required seeded": (CHAT, chat("Weather in Rome?", max_tokens=2048,
                                               temperature=0.8, seed=11, tools=TOOLS,
                                               tool_choice="required"), False),
    "chat tools auto seeded": (CHAT, chat("Weather in Paris?", max_tokens=2048,
                                           temperature=0.7, seed=12, tools=TOOLS,
                                           tool_choice="auto"), False),
}  # fmt: skip


async def test_router_answers_are_identical_through_ours_and_vllm_grpc(
    real: Harness, router_ours: str, router_reference: str, figures
) -> None:
    model = str(real.model_dir)
    mismatches, matched = [], []
    answers = {}
    for name, (path, body, streamed) in CASES.items():
        body = {"model": model, **body}
        ours = answers[name] = await ask(router_ours, path, body, streamed)
        theirs = await ask(router_reference, path, body, streamed)
        if ours != theirs:
            mismatches.append(f"{name}:\n  ours   {ours}\n  theirs {theirs}")
        else:
            matched.append(name)
        if name == "chat json schema" and ours[1][0][3] == "stop":
            jsonschema.validate(json.loads(ours[1][0][1]), SCHEMA)
        if name == "prompt over the context window":
            assert ours[0] == 400, ours
        elif not streamed:
            assert ours[0] == 200 and ours[1], (name, ours)  # a real answer, not an error
        else:
            assert ours[0] and all(text for _, text in ours[0]), (name, ours)
    assert not mismatches, "\n".join(mismatches)
    # tool_choice "required" becomes a JSON-schema constraint in the engine: the output is
    # a tool-call array (the random-weight model never closes it within the budget).
    content = answers["chat tools required"][1][0][1]
    assert content.lstrip().startswith("[") and '"get_weather"' in content, content
    # Seeded and long enough, the tool call closes: the router parses it into tool_calls.
    seeded = answers["chat tools required seeded"][1][0]
    assert seeded[3] == "tool_calls" and json.loads(seeded[2])[0]["function"]["name"] == (
        "get_weather"
    ), seeded
    # A max_tokens past the 256-token context is an answer that filled it, as on vLLM's server.
    for name in ("chat max_tokens past the context", "completions max_tokens past the context"):
        status, choices, (prompt_tokens, completion_tokens) = answers[name]
        assert (status, choices[0][3]) == (200, "length"), (name, answers[name])
        assert prompt_tokens + completion_tokens == MAX_MODEL_LEN, (name, answers[name])
    figures(f"{len(matched)} OpenAI cases identical through the router to ours and to vLLM --grpc")


async def test_128_concurrent_requests_through_the_router(
    real: Harness, router_ours: str, router_reference: str
) -> None:
    body = {"model": str(real.model_dir), **chat("Many at once", max_tokens=16, temperature=0)}
    reference = await ask(router_reference, CHAT, body, False)
    answers = await asyncio.gather(*(ask(router_ours, CHAT, body, False) for _ in range(128)))
    assert all(answer == reference for answer in answers)
    await wait_until(lambda: real_engine_idle(real), 10.0, "the engine to be idle")


async def test_client_disconnect_mid_stream_leaves_nothing_running(
    real: Harness, router_ours: str, figures: Callable[[str], None]
) -> None:
    await wait_until(lambda: real_engine_idle(real), 10.0, "the engine to be idle")
    body = {"model": str(real.model_dir), "stream": True, "ignore_eos": True,
            **chat("Keep going", max_tokens=200, temperature=0)}  # fmt: skip

    dropped = await drop_mid_stream(router_ours, body, real)
    figures(
        f"client hung up after 4 lines: the worker generated {dropped.generated} of 200 tokens "
        f"({dropped.at_hang_up} before the hang-up)"
    )
    await wait_until(lambda: real_engine_idle(real), 5.0, "the engine to abort the request")
    after = await real.stub.GetLoads(pb.GetLoadsRequest())
    assert after.requests_in_flight == 0 and after.ranks[0].running_requests == 0


async def test_both_routers_serve_chat_in_front_of_a_worker_with_a_control_key(
    real: Harness, router_ours: str, vllm_router_ours: str
) -> None:
    """The session's worker runs as a worker behind a router is deployed, with a control key:
    both routers (which send no key) serve chat, streamed and not, with the same tokens,
    while its control RPCs refuse a caller without the key."""
    import grpc

    from vllm_router.proto import vllm_native_pb2 as npb
    from vllm_router.proto import vllm_native_pb2_grpc as npb_grpc

    assert real.server.config.control_api_key is not None
    body = {"model": str(real.model_dir), **chat("Hello worker", max_tokens=12, temperature=0)}
    answers = {
        (router, streamed): await ask(base, CHAT, body, streamed)
        for router, base in (("smg", router_ours), ("vllm-router", vllm_router_ours))
        for streamed in (False, True)
    }
    unary = answers[("smg", False)]
    assert unary[0] == 200 and unary[1][0][1], unary  # status 200, some text
    assert answers[("vllm-router", False)][1] == unary[1]
    for router in ("smg", "vllm-router"):  # streamed: the same text, to the same finish
        text, finish, _ = answers[(router, True)]
        assert text == [(0, unary[1][0][1])] and finish == [(0, unary[1][0][3])], router
    async with grpc.aio.insecure_channel(real.address) as anonymous:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await npb_grpc.ControlStub(anonymous).PauseGeneration(npb.PauseGenerationRequest())
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert not await real.engine.is_paused()
