"""Media on both contracts over the mock engine: fetching rules, limits, bad input.

The mock (started with `image_token_id`) takes images honestly: one placeholder per item,
each item's content folded into what it generates (testing/mock_media.py). What a real
model does with images is proved on vLLM in test_real_media.py.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

import grpc
import pytest
from aiohttp import web
from PIL import Image
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc

from vllm_router.proto import vllm_engine_pb2 as pb
from vllm_router.server import ServerConfig

from harness import Harness, StartServer, collect_stream, request

IMAGE_TOKEN = 7


def png(width: int = 8, height: int = 6, color: tuple[int, int, int] = (200, 30, 30)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buffer, "PNG")
    return buffer.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


async def _tokens(harness: Harness, prompt: list[int], *items: pb.MultimodalItem) -> list[int]:
    req = request(prompt, max_tokens=4)
    req.multimodal_data.extend(items)
    return [t for m in await collect_stream(harness.stub, req) for t in m.token_ids]


async def _status(harness: Harness, prompt: list[int], *items: Any) -> tuple[Any, str]:
    try:
        await _tokens(harness, prompt, *items)
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


@pytest.fixture
async def vlm(start_mock: StartServer, tmp_path: Path) -> Harness:
    (tmp_path / "red.png").write_bytes(png())
    return await start_mock(
        image_token_id=IMAGE_TOKEN,
        max_images=2,
        allowed_local_media_path=str(tmp_path),
        allowed_media_domains="127.0.0.1",
    )


async def test_bytes_and_urls_of_one_image_give_the_same_answer(
    vlm: Harness, tmp_path: Path
) -> None:
    image = png()
    as_bytes = await _tokens(
        vlm, [5, IMAGE_TOKEN, 9], pb.MultimodalItem(modality="image", data=image)
    )
    as_data_url = await _tokens(
        vlm, [5, IMAGE_TOKEN, 9], pb.MultimodalItem(modality="image", url=data_url(image))
    )
    as_file = await _tokens(
        vlm,
        [5, IMAGE_TOKEN, 9],
        pb.MultimodalItem(modality="image", url=f"file://{tmp_path}/red.png"),
    )
    other = await _tokens(
        vlm, [5, IMAGE_TOKEN, 9], pb.MultimodalItem(modality="image", data=png(color=(0, 0, 255)))
    )
    assert as_bytes == as_data_url == as_file
    assert other != as_bytes  # the content reaches the engine
    assert vlm.server.requests.in_flight == frozenset()


async def test_http_urls_only_to_allowed_hosts_with_a_size_limit(start_mock: StartServer) -> None:
    image = png()
    answers = {
        "/red.png": web.Response(body=image, content_type="image/png"),
        "/big.png": web.Response(body=b"x" * 5000),
        "/gone.png": web.Response(status=404),
        "/moved.png": web.Response(status=302, headers={"Location": "http://example.com/"}),
    }

    async def answer(http: web.Request) -> web.Response:
        return answers[http.path]

    app = web.Application()
    for path in answers:
        app.router.add_get(path, answer)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    base = f"http://127.0.0.1:{port}"
    try:
        allowed = await start_mock(
            ServerConfig(port=0, media_max_bytes=4096),
            image_token_id=IMAGE_TOKEN,
            allowed_media_domains="127.0.0.1",
        )
        closed = await start_mock(image_token_id=IMAGE_TOKEN)

        def item(path: str) -> pb.MultimodalItem:
            return pb.MultimodalItem(modality="image", url=base + path)

        fetched = await _tokens(allowed, [IMAGE_TOKEN], item("/red.png"))
        assert fetched == await _tokens(
            allowed, [IMAGE_TOKEN], pb.MultimodalItem(modality="image", data=image)
        )
        code, message = await _status(closed, [IMAGE_TOKEN], item("/red.png"))
        assert code == grpc.StatusCode.PERMISSION_DENIED and "--allowed-media-domains" in message
        code, message = await _status(allowed, [IMAGE_TOKEN], item("/big.png"))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "at most 4096" in message
        code, message = await _status(allowed, [IMAGE_TOKEN], item("/gone.png"))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "HTTP 404" in message
        # A redirect is not followed (it could leave the allowed hosts).
        code, message = await _status(allowed, [IMAGE_TOKEN], item("/moved.png"))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "HTTP 302" in message
        code, message = await _status(
            allowed,
            [IMAGE_TOKEN],
            pb.MultimodalItem(modality="image", url="http://localhost:1/x.png"),
        )
        assert code == grpc.StatusCode.PERMISSION_DENIED and "'localhost'" in message
    finally:
        await runner.cleanup()


@pytest.mark.parametrize(
    ("items", "prompt", "code", "phrase"),
    [
        ([{"modality": "image", "url": "file:///etc/passwd"}], [IMAGE_TOKEN],
         grpc.StatusCode.PERMISSION_DENIED, "outside --allowed-local-media-path"),
        ([{"modality": "image", "url": "ftp://host/x.png"}], [IMAGE_TOKEN],
         grpc.StatusCode.INVALID_ARGUMENT, "scheme 'ftp'"),
        ([{"modality": "image", "url": "data:image/png;base64,@@@"}], [IMAGE_TOKEN],
         grpc.StatusCode.INVALID_ARGUMENT, "base64"),
        ([{"modality": "audio", "data": b"RIFF"}], [IMAGE_TOKEN],
         grpc.StatusCode.INVALID_ARGUMENT, "modality 'audio' is not taken"),
        ([{"modality": "image", "data": b"x"}] * 3, [IMAGE_TOKEN] * 3,
         grpc.StatusCode.INVALID_ARGUMENT, "at most 2 per prompt"),
        ([{"modality": "image", "data": b"x"}] * 2, [IMAGE_TOKEN],
         grpc.StatusCode.INVALID_ARGUMENT, "2 images sent but the prompt has 1"),
        ([{"modality": "image"}], [IMAGE_TOKEN],
         grpc.StatusCode.INVALID_ARGUMENT, "set exactly one"),
        ([{"modality": "image", "data": b"x", "url": "data:,x"}], [IMAGE_TOKEN],
         grpc.StatusCode.INVALID_ARGUMENT, "sets data and url"),
        ([{"data": b"x"}], [IMAGE_TOKEN], grpc.StatusCode.INVALID_ARGUMENT, "modality is empty"),
        ([{"modality": "image", "processed": {"offset": 0, "length": 1, "hash": "h",
           "tensors": {"pixel_values": {"shape": [2, 2], "dtype": "float32",
                                        "data": b"\0" * 12}}}}],
         [IMAGE_TOKEN], grpc.StatusCode.INVALID_ARGUMENT, "expected 16"),
        ([{"modality": "image", "processed": {"offset": 0, "length": 1, "hash": "h",
           "tensors": {"pixel_values": {"shape": [1], "dtype": "complex64", "data": b"\0" * 8}}}}],
         [IMAGE_TOKEN], grpc.StatusCode.INVALID_ARGUMENT, "dtype 'complex64'"),
        ([{"modality": "image", "processed": {"offset": 3, "length": 4, "hash": "h",
           "tensors": {"pixel_values": {"shape": [1], "dtype": "float32", "data": b"\0" * 4}}}}],
         [IMAGE_TOKEN], grpc.StatusCode.INVALID_ARGUMENT, "not inside the 1-token prompt"),
    ],
)  # fmt: skip
async def test_bad_media_gets_a_clear_status(
    vlm: Harness, items: list[dict[str, Any]], prompt: list[int], code: Any, phrase: str
) -> None:
    got, message = await _status(vlm, prompt, *(pb.MultimodalItem(**item) for item in items))
    assert (got, phrase in message) == (code, True), message
    assert vlm.server.requests.in_flight == frozenset()


async def test_a_text_only_model_refuses_media(mock: Harness) -> None:
    code, message = await _status(
        mock, [IMAGE_TOKEN], pb.MultimodalItem(modality="image", data=png())
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "text-only" in message
    info = await mock.stub.GetModelInfo(pb.GetModelInfoRequest())
    assert dict(info.media_limits) == {} and list(info.media_url_schemes) == []


async def test_model_info_says_what_media_the_worker_takes(vlm: Harness) -> None:
    info = await vlm.stub.GetModelInfo(pb.GetModelInfoRequest())
    assert dict(info.media_limits) == {"image": 2}
    assert list(info.media_url_schemes) == ["data", "http", "https", "file"]
    stub = vpb_grpc.VllmEngineStub(vlm.channel)
    assert (await stub.GetModelInfo(vpb.GetModelInfoRequest())).supports_vision
    server = await stub.GetServerInfo(vpb.GetServerInfoRequest())
    assert (server.mm_processor, server.mm_media_ref_schemes, server.mm_item_limits) == (
        "inprocess", "data,http,https,file", "image=2",
    )  # fmt: skip
    # Tensors only inline: no /dev/shm advertised, so a router never sends them there.
    assert server.shm_namespace_id == ""


def _vllm_request(ids: list[int], **media: Any) -> vpb.GenerateRequest:
    return vpb.GenerateRequest(
        tokenized=vpb.TokenizedInput(input_ids=ids),
        sampling_params=vpb.SamplingParams(max_tokens=4, temperature=0),
        stream=False,
        **media,
    )


async def _vllm_tokens(harness: Harness, message: vpb.GenerateRequest) -> list[int]:
    responses = [r async for r in vpb_grpc.VllmEngineStub(harness.channel).Generate(message)]
    return list(responses[-1].complete.output_ids)


async def test_vllm_contract_media_refs_match_our_contract(vlm: Harness) -> None:
    image = png()
    refs = vpb.MediaRefs(items=[vpb.MediaRef(modality=common_pb2.IMAGE, url=data_url(image))])
    theirs = await _vllm_tokens(vlm, _vllm_request([5, IMAGE_TOKEN, 9], media_refs=refs))
    ours = await _tokens(vlm, [5, IMAGE_TOKEN, 9], pb.MultimodalItem(modality="image", data=image))
    assert theirs == ours
    stub = vpb_grpc.VllmEngineStub(vlm.channel)
    for bad, phrase in [
        (_vllm_request([IMAGE_TOKEN], media_refs=vpb.MediaRefs()), "carries no items"),
        (_vllm_request([IMAGE_TOKEN], media_refs=vpb.MediaRefs(items=[vpb.MediaRef(modality=1)])),
         "url is empty"),
        (_vllm_request([IMAGE_TOKEN], media_refs=vpb.MediaRefs(
            items=[vpb.MediaRef(modality=1, url="file:///etc/passwd")])),
         "outside --allowed-local-media-path"),
    ]:  # fmt: skip
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            _ = [r async for r in stub.Generate(bad)]
        assert phrase in (failed.value.details() or "")
    assert vlm.server.requests.in_flight == frozenset()
