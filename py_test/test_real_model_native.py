"""The real, trained model (SmolLM2-135M-Instruct) through the vllm-project's router: in front
of our native contract and in front of vLLM's Rust front end (same model, same engine
flags), where answers mean something: a factual answer, seeded sampling, a stop string, a
JSON schema that parses, streamed chat, completions from token ids."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import pytest_asyncio
from test_real_model import TRIP

from harness import Harness, require
from native_servers import vllm_router, vllm_router_in_thread, vllm_rs_path, vllm_rs_server
from real_engine import real_model
from routers import CHAT, COMPLETIONS, ask, chat, in_thread

pytestmark = pytest.mark.vllm


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def trained_vllm_routers(trained: Harness) -> AsyncIterator[tuple[str, str]]:
    """(vllm-router in front of ours, vllm-router in front of vllm-rs), same model and flags."""
    require(vllm_rs_path() is not None, "vllm-rs is not installed (make test)")
    model, flags = real_model()
    folder = Path(model)
    async with contextlib.AsyncExitStack() as stack:  # each started in a thread: in_thread
        worker = await stack.enter_async_context(
            in_thread(vllm_rs_server(folder, flags, folder.parent / "vllm-rs-trained.log"))
        )
        reference = await stack.enter_async_context(
            in_thread(vllm_router([worker], folder, folder.parent / "vllm-router-ref-trained.log"))
        )
        log = folder.parent / "vllm-router-ours-trained.log"
        async with vllm_router_in_thread([trained.address], folder, log) as ours:
            yield ours, reference


def cases(prompt_ids: list[int]) -> dict[str, tuple[str, dict, bool]]:
    france = "What is the capital of France?"
    trip = {"type": "json_schema", "json_schema": {"name": "trip", "schema": TRIP}}
    return {
        "chat greedy": (CHAT, chat(france, max_tokens=24, temperature=0), False),
        "chat greedy streamed": (CHAT, chat(france, max_tokens=24, temperature=0), True),
        "chat seeded": (CHAT, chat("Name a fruit.", max_tokens=24, temperature=0.7, seed=3),
                        False),
        "chat stop string": (CHAT, chat(france, max_tokens=40, temperature=0, stop=[","]), False),
        "chat json schema": (CHAT, chat("Plan a trip to Rome as JSON.", max_tokens=80,
                                        temperature=0, response_format=trip), False),
        "completions from token ids": (COMPLETIONS, {"prompt": prompt_ids, "max_tokens": 8,
                                                     "temperature": 0}, False),
    }  # fmt: skip


async def test_vllm_router_answers_are_identical_through_ours_and_vllm_rs(
    trained: Harness, trained_vllm_routers: tuple[str, str], figures: Any
) -> None:
    ours_base, reference_base = trained_vllm_routers
    prompt_ids = await trained.engine.tokenize("The capital of France is")
    answers: dict[str, Any] = {}
    mismatches = []
    for name, (path, body, streamed) in cases(prompt_ids).items():
        body = {"model": str(trained.model_dir), **body}
        ours = answers[name] = await ask(ours_base, path, body, streamed)
        theirs = await ask(reference_base, path, body, streamed)
        if ours != theirs:
            mismatches.append(f"{name}:\n  ours   {ours}\n  theirs {theirs}")
    assert not mismatches, "\n".join(mismatches)
    # The words mean something (greedy chat on this 135M model rambles, the same on both).
    status, choices, _ = answers["completions from token ids"]
    assert status == 200 and "Paris" in choices[0][1], answers["completions from token ids"]
    assert answers["chat stop string"][1][0][3] == "stop"
    trip = json.loads(answers["chat json schema"][1][0][1])
    jsonschema.validate(trip, TRIP)
    figures(
        f"trained model through vllm-router, ours = vllm-rs on {len(answers)} cases: "
        f"'The capital of France is' -> {choices[0][1]!r}; JSON {trip}"
    )
