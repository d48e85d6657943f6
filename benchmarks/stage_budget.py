"""The per-token budget, stage by stage: what a token-id request and a plain decode step cost
in this process, each stage timed on its own (no gRPC client; the engine core only where a
stage talks to it). Prints one JSON line per stage and a table.

Per request (µs per request; a 32-token prompt, greedy, 64 tokens, token ids only):
the contract's message decode and conversion, our SamplingParams, vLLM's rendering and input
processing (`InputProcessor.process_inputs`), its output-processor registration, the
engine-core message encode, `AsyncLLM.add_request` whole (with its ZMQ send), and the
adapter's admission into the engine (`VllmEngine.generate` up to the engine core: the path
a request takes, direct or through `add_request`).

Per step (µs per stream per engine step; 64 streams in one step): the engine-core outputs'
msgpack decode, vLLM's output processing of the step (its path), our fast decode step
(FastOutputs + LeanStream + direct steps to a receiver that takes everything), and each
contract's render + encode of a decode step's message.

What the Rust front ends do instead of each stage is in benchmarks/results/stage-budget.md.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

PROMPT = [1 + i % 400 for i in range(32)]
STREAMS = 64


def timed(fn: Callable[[], Any], number: int, repeat: int = 5) -> float:
    """Median µs per call over `repeat` runs of `number` calls."""
    runs = []
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(number):
            fn()
        runs.append((time.perf_counter() - start) * 1e6 / number)
    return statistics.median(runs)


def _native_messages() -> tuple[Any, bytes]:
    from vllm_router.proto import vllm_native_pb2 as npb

    request = npb.GenerateRequest(request_id="r", token_ids=npb.TokenIds(ids=PROMPT))
    request.temperature = 0.0
    request.stopping.max_new_tokens = 64
    request.stopping.ignore_eos = True
    request.response.output_text = False
    request.response.output_token_ids = True
    return request, request.SerializeToString()


def _native_request(engine: Any) -> tuple[Any, Any]:
    """The native request as the adapter gets it, and its SamplingParams."""
    from vllm_router.contracts.vllm_native import convert

    generation = convert.to_generation_request(_native_messages()[0], engine.facts, (), None)
    return generation, engine._sampling_params(generation, len(PROMPT))


def _engine_request(engine: Any, request_id: str, params: Any) -> Any:
    """vLLM's EngineCoreRequest for the prompt, with its internal id, as add_request makes it."""
    processor = engine.llm.input_processor
    request = processor.process_inputs(
        request_id, engine._engine_prompt(PROMPT), params, supported_tasks=("generate",)
    )
    processor.assign_request_id(request)
    return request


def request_stages(engine: Any, number: int) -> dict[str, float]:
    from vllm_router.contracts.vllm_native import convert
    from vllm_router.proto import vllm_native_pb2 as npb

    facts = engine.facts
    message, wire = _native_messages()
    out: dict[str, float] = {}
    out["native: message decode"] = timed(lambda: npb.GenerateRequest.FromString(wire), number)
    out["native: conversion"] = timed(
        lambda: convert.to_generation_request(message, facts, (), None), number
    )
    generation = convert.to_generation_request(message, facts, (), None)
    out["our SamplingParams"] = timed(
        lambda: engine._sampling_params(generation, len(PROMPT)), number
    )
    llm = engine.llm
    params = engine._sampling_params(generation, len(PROMPT))
    out["vLLM: rendering"] = timed(lambda: engine._engine_prompt(PROMPT), number)
    prompt = engine._engine_prompt(PROMPT)
    tasks = ("generate",)
    processor = llm.input_processor

    def process() -> Any:
        request = processor.process_inputs("r", prompt, params, supported_tasks=tasks)
        processor.assign_request_id(request)
        return request

    out["vLLM: input processing"] = timed(process, number)
    encoder = llm.engine_core.encoder
    request = process()
    out["vLLM: engine-core encode"] = timed(lambda: encoder.encode(request), number)

    outputs = llm.output_processor
    runs = []
    for _ in range(5):
        spent = 0.0
        for i in range(number):
            request = process()
            request.request_id = f"reg-{i}"
            start = time.perf_counter()
            outputs.add_request(request, None, None, 0, None)
            spent += time.perf_counter() - start
            outputs.request_states.pop(request.request_id)
            outputs.external_req_ids.pop(request.external_req_id, None)
        runs.append(spent * 1e6 / number)
    out["vLLM: output registration"] = statistics.median(runs)
    return out


async def admission_stages(engine: Any, number: int) -> dict[str, float]:
    """The whole entry into the engine core, real, in CPU time of this process: the
    engine-core send alone, vLLM's add_request, and the adapter's own entry (whichever path
    it takes); each request aborted before the next (the abort's CPU timed apart and
    taken off)."""
    llm = engine.llm
    core = llm.engine_core
    generation, params = _native_request(engine)
    counter = 0

    async def core_send() -> tuple[float, str]:
        nonlocal counter
        counter += 1
        request = _engine_request(engine, f"c{counter}", params)
        start = time.process_time()
        await core.add_request_async(request)
        return time.process_time() - start, request.request_id

    async def vllm_add() -> tuple[float, str]:
        nonlocal counter
        counter += 1
        prompt = engine._engine_prompt(PROMPT)
        start = time.process_time()
        queue = await llm.add_request(f"v{counter}", prompt, params)
        return time.process_time() - start, queue.request_id

    async def ours() -> tuple[float, str]:
        nonlocal counter
        counter += 1
        request = dataclasses.replace(generation, request_id=f"o{counter}")
        start = time.process_time()
        steps = engine.generate(request)
        first = asyncio.ensure_future(steps.__anext__())
        await asyncio.sleep(0)  # the generator runs up to the engine core and waits there
        spent = time.process_time() - start
        first.cancel()
        try:
            await first
        except BaseException:
            pass
        await steps.aclose()
        return spent, ""

    entry = engine.direct_entry

    async def ours_through_add_request() -> tuple[float, str]:
        engine.direct_entry = None
        try:
            return await ours()
        finally:
            engine.direct_entry = entry

    out: dict[str, float] = {}
    for name, fn in (
        ("vLLM: engine-core send", core_send),
        ("vLLM: add_request whole", vllm_add),
        ("ours: into the engine, through add_request", ours_through_add_request),
        ("ours: into the engine, direct entry", ours),
    ):
        if fn is ours and entry is None:
            continue
        runs = []
        for _ in range(5):
            spent = 0.0
            for _ in range(number):
                took, request_id = await fn()
                spent += took
                if request_id:
                    await llm.abort(request_id, internal=True)
            runs.append(spent * 1e6 / number)
            for _ in range(1000):  # the aborts reach the output processor: up to 10 s
                if not llm.output_processor.request_states:
                    break
                await asyncio.sleep(0.01)
        out[name] = statistics.median(runs)
    return out


def step_stages(engine: Any, number: int) -> dict[str, float]:
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    from vllm_router.engine.vllm.fast_outputs import FastOutputs
    from vllm_router.engine.vllm.lean import LeanStream

    llm = engine.llm
    outputs = llm.output_processor
    _, params = _native_request(engine)
    ids = []
    for i in range(STREAMS):
        request = _engine_request(engine, f"s{i}", params)
        outputs.add_request(request, None, None, 0, None)
        state = outputs.request_states[request.request_id]
        state.is_prefilling = False
        ids.append(request.request_id)

    def step(token: int) -> list[Any]:
        return [EngineCoreOutput(request_id=i, new_token_ids=[token]) for i in ids]

    out: dict[str, float] = {}
    encoder, decoder = MsgpackEncoder(), MsgpackDecoder(EngineCoreOutputs)
    frames = encoder.encode(EngineCoreOutputs(outputs=step(7)))
    out["vLLM: engine-core outputs decode"] = (
        timed(lambda: decoder.decode(frames), number) / STREAMS
    )

    def vllm_path() -> None:
        outputs.process_outputs(step(7), time.monotonic(), None)

    # vLLM's path with a queue per request, as AsyncLLM.generate registers them.
    from vllm.v1.engine.output_processor import RequestOutputCollector

    for i in ids:
        outputs.request_states[i].queue = RequestOutputCollector(params.output_kind, i)
    out["vLLM: output processing (its path)"] = timed(vllm_path, number) / STREAMS
    fast = FastOutputs(outputs, count_nans=False)
    taken: list[list[int]] = []

    def receiver(token_ids: list[int], completion_tokens: int) -> bool:
        taken.append(token_ids)
        return True

    for i in ids:
        state = outputs.request_states[i]
        stream = LeanStream(i, state, detokenize=False, prompt_tokens=32, receiver=receiver)
        stream._started = True
        stream._waiter = asyncio.get_event_loop().create_future()
        fast.register(i, stream)

    def fast_path() -> None:
        taken.clear()
        outputs.process_outputs(step(7), time.monotonic(), None)

    built = timed(lambda: step(7), number) / STREAMS
    out["ours: fast plain step (FastOutputs, LeanStream, direct step)"] = (
        timed(fast_path, number) / STREAMS - built
    )
    out["vLLM: output processing (its path)"] -= built
    assert taken, "the fast path gave the receiver nothing"
    outputs.process_outputs = fast._vllm_path
    for i in ids:
        outputs.request_states.pop(i)
    out.update(render_stages(engine, number))
    return out


def render_stages(engine: Any, number: int) -> dict[str, float]:
    """Each contract's rendering of a plain decode step into its message (through the
    step renderer a task uses and the direct-step renderer a direct send uses), and the encode."""
    from vllm_router.contracts.vllm_engine_v1 import responses as ours
    from vllm_router.contracts.vllm_grpc_engine import responses as official
    from vllm_router.contracts.vllm_native import responses as native
    from vllm_router.engine import EngineStep
    from vllm_router.proto import vllm_native_pb2 as npb

    step = EngineStep(
        token_ids=[7], text="", finished=False, prompt_tokens=32, completion_tokens=9,
        cached_tokens=0,
    )  # fmt: skip
    wanted = native.Wanted.of(npb.ResponseOptions())
    native_decode = native.direct_step_renderer(wanted)
    official_decode = official.direct_step_renderer()
    ours_decode = ours.direct_step_renderer("r")
    # The step renderer (a task's send) and the direct-step renderer (a direct send) of each.
    renders = {
        "native": lambda: native.sequence_output(step, wanted, frozenset()),
        "native (direct-step renderer)": lambda: native_decode([7], step, 9),
        "vllm.grpc.engine": lambda: official.chunk(step, 0, None, 0),
        "vllm.grpc.engine (direct-step renderer)": lambda: official_decode([7], step, 9),
        "vllm.engine.v1": lambda: ours.stream_message("r", step, None),
        "vllm.engine.v1 (direct-step renderer)": lambda: ours_decode([7], step, 9),
    }
    out: dict[str, float] = {}
    for name, render in renders.items():
        try:
            message = render()
        except TypeError as exc:  # a renderer's signature this script does not know
            print(json.dumps({"skipped": name, "why": str(exc)}))
            continue
        out[f"{name}: render a decode step"] = timed(render, number * 10)
        out[f"{name}: encode it"] = timed(message.SerializeToString, number * 10)
    return out


async def main(args: argparse.Namespace) -> None:
    from vllm.engine.arg_utils import AsyncEngineArgs

    from vllm_router.engine.vllm import VllmEngine

    engine = VllmEngine.from_engine_args(
        AsyncEngineArgs(
            model=args.model, max_model_len=512, gpu_memory_utilization=0.3, enforce_eager=True
        )
    )
    try:
        stages: dict[str, float] = {}
        stages.update(request_stages(engine, args.number))
        stages.update(await admission_stages(engine, args.number // 4))
        per_request = dict(stages)
        per_step = step_stages(engine, args.number // 10)
        for name, value in per_request.items():
            print(json.dumps({"stage": name, "us_per_request": round(value, 2)}))
        for name, value in per_step.items():
            print(json.dumps({"stage": name, "us_per_stream_step": round(value, 2)}))
    finally:
        await engine.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--number", type=int, default=2000, help="calls per timed run")
    import uvloop

    uvloop.run(main(parser.parse_args()))
