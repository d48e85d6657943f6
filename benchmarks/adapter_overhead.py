"""The adapter's own output path, in-process (no gRPC): CPU per token of the same requests
through `VllmEngine.generate` on its two output paths, alternated; best and median of each.

`fast` takes a token-only request's plain decode steps from the engine core's outputs in
one loop (engine/vllm/fast_outputs.py), the rest as `lean`; `lean` takes a request's
tokens from vLLM's OutputProcessor without RequestOutputs (engine/vllm/lean.py); `vllm`
reads AsyncLLM.generate's RequestOutputs. The engine core
runs in its own process and is not counted; both paths share this process's engine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any


async def _run(
    engine: Any, paths: list[str], requests: int, concurrency: int, output_len: int, rounds: int
) -> dict[str, list[float]]:
    from vllm_router.engine import GenerationRequest, SamplingOptions

    options = SamplingOptions(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    counter = 0
    results: dict[str, list[float]] = {path: [] for path in paths}

    async def one(tokens: list[int]) -> None:
        nonlocal counter
        counter += 1
        request = GenerationRequest(
            request_id=f"r{counter}",
            prompt_token_ids=[1 + (counter + i) % 400 for i in range(32)],
            prompt_text=None,
            sampling=options,
            detokenize=False,
        )
        async for step in engine.generate(request):
            tokens[0] += len(step.token_ids)

    async def wave(n: int) -> int:
        tokens = [0]
        queue = list(range(n))

        async def worker() -> None:
            while queue:
                queue.pop()
                await one(tokens)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return tokens[0]

    await wave(2 * concurrency)  # warm-up
    for _ in range(rounds):
        for path in paths:
            engine.lean_outputs = path in ("fast", "lean")
            engine.fast_outputs.enabled = path == "fast"
            cpu = time.process_time()
            tokens = await wave(requests)
            results[path].append((time.process_time() - cpu) * 1e6 / tokens)
    return results


async def main(args: argparse.Namespace) -> None:
    from vllm.engine.arg_utils import AsyncEngineArgs

    from vllm_router.engine.vllm import VllmEngine

    engine = VllmEngine.from_engine_args(
        AsyncEngineArgs(
            model=args.model,
            max_model_len=args.max_model_len,
            gpu_memory_utilization=0.3,
            enforce_eager=True,
        )
    )
    try:
        for concurrency in args.concurrency:
            paths = ["fast", "lean", "vllm"]
            results = await _run(
                engine, paths, args.requests, concurrency, args.output_len, args.rounds
            )
            median = {path: statistics.median(values) for path, values in results.items()}
            line: dict[str, Any] = {
                "concurrency": concurrency,
                "cpu_us_per_token": {
                    path: [round(v, 1) for v in values] for path, values in results.items()
                },
            }
            for path in paths:
                line[f"median_{path}"] = round(median[path], 1)
                line[f"median_{path}_vs_vllm"] = round(median[path] / median["vllm"], 3)
            print(json.dumps(line), flush=True)
    finally:
        await engine.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5, help="alternations of the two paths")
    parser.add_argument(
        "--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[64, 256]
    )
    import uvloop

    uvloop.run(main(parser.parse_args()))
