"""The limit: the same AsyncLLM driven in-process, no RPC. Prints one JSON line per level.

Its front-end CPU is this whole process (AsyncLLM's output handling and the trivial
client loop); the engine core runs in its own process and is not counted.
"""

from __future__ import annotations

import argparse
import json

from clients import drive
from procstat import CpuWindow, rss_mb
from workload import Record, Workload, add_cpu, summarize


async def main(args: argparse.Namespace) -> None:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.sampling_params import RequestOutputKind, SamplingParams
    from vllm.v1.engine.async_llm import AsyncLLM

    engine_args = AsyncEngineArgs(
        model=args.model,
        max_model_len=args.max_model_len,
        gpu_memory_utilization=0.3,
        enforce_eager=True,
    )
    llm = AsyncLLM.from_engine_args(engine_args)
    counter = 0

    def one_for(workload: Workload):
        async def one(i: int, prompt: list[int], record: Record) -> None:
            nonlocal counter
            counter += 1
            params = SamplingParams(
                temperature=workload.temperature,
                max_tokens=workload.output_len,
                ignore_eos=True,
                seed=i,
                detokenize=not workload.skip_detokenize,
                output_kind=RequestOutputKind.DELTA,
            )
            async for out in llm.generate({"prompt_token_ids": prompt}, params, f"r{counter}"):
                record.message(len(out.outputs[0].token_ids))

        return one

    try:
        for spec in json.loads(args.levels):
            workload = Workload(**spec)
            warm_up = Workload(**{**spec, "requests": 2 * workload.concurrency})
            await drive(warm_up, one_for(workload))
            cpu = CpuWindow(None)
            cpu.start()
            records, wall = await drive(workload, one_for(workload))
            result = summarize("engine", workload, records, wall)
            add_cpu(result, cpu.stop()[0], rss_mb())
            result["text"] = not workload.skip_detokenize
            print("RESULT " + json.dumps(result), flush=True)
    finally:
        llm.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--levels", required=True, help="JSON list of Workload fields")
    import uvloop

    uvloop.run(main(parser.parse_args()))
