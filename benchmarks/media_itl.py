"""Do image requests stall the token streams of everyone else? Inter-token latency of text
streams with and without image requests arriving meanwhile, on the real engine.

    VLLM_CPU_KVCACHE_SPACE=1 .venv/bin/python benchmarks/media_itl.py [--rounds 3]

One server (ours, in-process, the tiny Idefics3 of the test suite) runs 32 text streams
of 96 tokens; in "images" rounds 8 image requests (1024x1024 JPEGs, decoded and resized by
the model's processor) arrive while they stream. Rounds alternate (text, images, text,
...) on this noisy machine; each prints the text streams' gap p50/p99 between messages,
as a client sees them, and the image requests' latency.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import random
import statistics
import sys
import time
from pathlib import Path

from PIL import Image

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "py_test"))

from vllm_router.proto import vllm_engine_pb2 as pb  # noqa: E402
from vllm_router.server import ServerConfig  # noqa: E402

import real_engine  # noqa: E402
from harness import start_harness  # noqa: E402

TEXT_STREAMS, TEXT_TOKENS, IMAGES = 32, 96, 8
IMAGE_TOKEN = 513  # the tiny Idefics3's <image>


def jpeg(seed: int, side: int = 1024) -> bytes:
    rng = random.Random(seed)
    image = Image.frombytes("RGB", (side, side), rng.randbytes(side * side * 3))
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


async def text_stream(stub, prompt: list[int], gaps: list[float]) -> None:
    req = pb.GenerateRequest(
        prompt_token_ids=prompt,
        skip_detokenize=True,
        sampling_params=pb.SamplingParams(temperature=0, max_tokens=TEXT_TOKENS, ignore_eos=True),
    )
    last = None
    async for _ in stub.GenerateStream(req):
        now = time.perf_counter()
        if last is not None:
            gaps.append(now - last)
        last = now


async def image_request(stub, data: bytes, delay: float, took: list[float]) -> None:
    await asyncio.sleep(delay)
    req = pb.GenerateRequest(
        prompt_token_ids=[0, 300, IMAGE_TOKEN, 263, 28],
        sampling_params=pb.SamplingParams(temperature=0, max_tokens=4),
    )
    req.multimodal_data.add(modality="image", data=data)
    started = time.perf_counter()
    async for _ in stub.GenerateStream(req):
        pass
    took.append(time.perf_counter() - started)


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[q - 1] * 1000 if len(values) > 1 else 0.0


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    model = real_engine.tiny_vlm()
    engine = await real_engine.start_engine(model, real_engine.VLM_FLAGS)
    harness = await start_harness(engine, ServerConfig(port=0), model)
    images = [jpeg(i) for i in range(IMAGES)]
    print(f"image payload: {len(images[0]) / 1e6:.1f} MB JPEG, 1024x1024")
    try:
        # Warm-up: the first image request loads the processor.
        await image_request(harness.stub, images[0], 0, [])
        for round_no in range(args.rounds):
            for with_images in (False, True):
                gaps: list[float] = []
                took: list[float] = []
                prompts = [[1 + (7 * i + j) % 500 for j in range(12)] for i in range(TEXT_STREAMS)]
                tasks = [text_stream(harness.stub, p, gaps) for p in prompts]
                if with_images:
                    # Arriving over the streams' first second, while they decode.
                    tasks += [
                        image_request(harness.stub, data, 0.2 + 0.1 * i, took)
                        for i, data in enumerate(images)
                    ]
                await asyncio.gather(*tasks)
                label = "images" if with_images else "text  "
                extra = (
                    f", image requests p50 {statistics.median(took) * 1000:.0f} ms" if took else ""
                )
                print(
                    f"round {round_no} {label}: ITL p50 {pct(gaps, 50):.1f} ms, "
                    f"p99 {pct(gaps, 99):.1f} ms over {len(gaps)} gaps{extra}"
                )
    finally:
        await harness.close()


if __name__ == "__main__":
    asyncio.run(main())
