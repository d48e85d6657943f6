"""Load generators: one async client per protocol, all measured the same way."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from workload import Record, Workload

OneRequest = Callable[[int, list[int], Record], Awaitable[None]]


def request_id(i: int) -> str:
    """Unique across runs against one server (a worker refuses an id still in flight)."""
    return f"bench-{i}-{time.monotonic_ns()}"


async def drive(workload: Workload, one: OneRequest) -> tuple[list[Record], float]:
    """Run `workload.requests` requests, `workload.concurrency` at a time."""
    prompts = workload.prompts()
    records = [Record(start=0.0) for _ in prompts]
    queue = iter(range(len(prompts)))

    async def worker() -> None:
        for i in queue:
            record = records[i]
            record.start = time.perf_counter()
            try:
                await one(i, prompts[i], record)
            except Exception as exc:  # counted, reported in the table
                record.error = f"{type(exc).__name__}: {exc}"[:200]

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(workload.concurrency)))
    return records, time.perf_counter() - started


def ours(address: str, workload: Workload) -> tuple[Callable[[], Awaitable[None]], OneRequest]:
    """Ours, through the package's own client library."""
    from vllm_router.client import WorkerClient

    worker = WorkerClient(address, timeout=None)

    async def one(i: int, prompt: list[int], record: Record) -> None:
        stream = worker.stream(
            prompt,
            skip_detokenize=workload.skip_detokenize,
            temperature=workload.temperature,
            max_tokens=workload.output_len,
            ignore_eos=True,
            seed=i,
            **(
                {"stream_interval": workload.stream_interval}
                if workload.stream_interval > 1
                else {}
            ),
        )
        async for message in stream:
            record.message(len(message.token_ids))

    return worker.close, one


def ours_compact(
    address: str, workload: Workload
) -> tuple[Callable[[], Awaitable[None]], OneRequest]:
    """As `ours_batched`, the requests asking for the compact shape (compact_tokens)."""
    return ours_batched(address, workload, compact=True)


def ours_batched(
    address: str, workload: Workload, compact: bool = False
) -> tuple[Callable[[], Awaitable[None]], OneRequest]:
    """Ours, every request on one GenerateBatch stream, read as a router would: one reader
    hands each update to its request's record (no per-request stream objects, so the
    client's own CPU stays out of the engine's way, as with the other targets' clients)."""
    from vllm_router.proto import vllm_engine_pb2 as pb
    from vllm_router.proto import vllm_engine_pb2_grpc as pb_grpc

    channel = grpc.aio.insecure_channel(address)
    stub = pb_grpc.VllmEngineStub(channel)
    outgoing: asyncio.Queue[Any] = asyncio.Queue()
    waiting: dict[str, tuple[Record, asyncio.Future[None]]] = {}
    reader: list[asyncio.Task[None]] = []  # started on first use, inside the running loop

    async def requests() -> AsyncIterator[Any]:
        while (item := await outgoing.get()) is not None:
            yield item

    async def read(call: Any) -> None:
        async for message in call:
            for update in message.updates:
                record, done = waiting[update.request_id]
                record.message(len(update.token_ids))
                if update.is_finished:
                    del waiting[update.request_id]
                    done.set_result(None)
            runs = message.tokens
            for run_id, count in zip(runs.request_ids, runs.token_counts, strict=True):
                waiting[run_id][0].message(count)
            for error in message.errors:
                _, done = waiting.pop(error.request_id)
                done.set_exception(RuntimeError(f"{error.code}: {error.message}"))

    async def one(i: int, prompt: list[int], record: Record) -> None:
        if not reader:
            reader.append(asyncio.create_task(read(stub.GenerateBatch(requests()))))
        rid = request_id(i)
        done = asyncio.get_running_loop().create_future()
        waiting[rid] = (record, done)
        request = pb.GenerateRequest(
            request_id=rid,
            prompt_token_ids=prompt,
            skip_detokenize=workload.skip_detokenize,
            sampling_params=pb.SamplingParams(
                temperature=workload.temperature,
                max_tokens=workload.output_len,
                ignore_eos=True,
                seed=i,
            ),
        )
        outgoing.put_nowait(pb.GenerateBatchRequest(generate=request, compact_tokens=compact))
        await done

    async def close() -> None:
        outgoing.put_nowait(None)
        if reader:
            await reader[0]
        await channel.close()

    return close, one


def vllm_grpc(address: str, workload: Workload) -> tuple[Callable[[], Awaitable[None]], OneRequest]:
    """vLLM's own --grpc launcher (smg-grpc-servicer), its own proto."""
    from smg_grpc_proto import vllm_engine_pb2 as spb
    from smg_grpc_proto import vllm_engine_pb2_grpc as spb_grpc

    channel = grpc.aio.insecure_channel(address)
    stub = spb_grpc.VllmEngineStub(channel)

    async def one(i: int, prompt: list[int], record: Record) -> None:
        request = spb.GenerateRequest(
            request_id=request_id(i),
            tokenized=spb.TokenizedInput(input_ids=prompt),
            stream=True,
            sampling_params=spb.SamplingParams(
                temperature=workload.temperature,
                top_p=1.0,
                max_tokens=workload.output_len,
                ignore_eos=True,
                seed=i,
                skip_special_tokens=True,
                n=1,
            ),
        )
        async for message in stub.Generate(request):
            if message.HasField("chunk"):
                record.message(len(message.chunk.token_ids))

    return channel.close, one


def native(address: str, workload: Workload) -> tuple[Callable[[], Awaitable[None]], OneRequest]:
    """vLLM's native contract (vllm.Inference.GenerateStream), as vllm-router sends it: token
    ids in, token ids out, no text."""
    from vllm_router.proto import vllm_native_pb2 as npb
    from vllm_router.proto import vllm_native_pb2_grpc as npb_grpc

    channel = grpc.aio.insecure_channel(address)
    stub = npb_grpc.InferenceStub(channel)

    async def one(i: int, prompt: list[int], record: Record) -> None:
        request = npb.GenerateRequest(
            request_id=request_id(i),
            token_ids=npb.TokenIds(ids=prompt),
            temperature=workload.temperature,
            sampling=npb.RandomSampling(seed=i),
            stopping=npb.StoppingCriteria(max_new_tokens=workload.output_len, ignore_eos=True),
            response=npb.ResponseOptions(output_text=False, output_token_ids=True),
        )
        async for message in stub.GenerateStream(request):
            record.message(len(message.outputs.token_ids))  # prompt_info alone: none

    return channel.close, one


def _openai_session(base: str) -> tuple[Any, Callable[[], Awaitable[str]]]:
    """An HTTP session for an OpenAI-style server, and the name of the model it serves."""
    import aiohttp

    session = aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=600),
        connector=aiohttp.TCPConnector(limit=0),
    )
    served: list[str] = []

    async def served_model() -> str:
        if not served:
            async with session.get(base + "/v1/models") as response:
                served.append((await response.json())["data"][0]["id"])
        return served[0]

    return session, served_model


async def _sse(response: Any) -> AsyncIterator[dict]:
    """The JSON of each `data:` event of a server-sent-events response, until [DONE]."""
    async for raw in response.content:
        line = raw.strip()
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            yield json.loads(line[6:])


def vllm_http(base: str, workload: Workload) -> tuple[Callable[[], Awaitable[None]], OneRequest]:
    """vLLM's OpenAI server: /v1/completions with stream=true (SSE)."""
    session, served_model = _openai_session(base)

    async def one(i: int, prompt: list[int], record: Record) -> None:
        body = {
            "model": await served_model(),
            "prompt": prompt,
            "max_tokens": workload.output_len,
            "temperature": workload.temperature,
            "ignore_eos": True,
            "seed": i,
            "stream": True,
            "return_token_ids": True,
        }
        async with session.post(base + "/v1/completions", json=body) as response:
            response.raise_for_status()
            async for chunk in _sse(response):
                choices = chunk.get("choices") or []
                if choices:
                    ids = choices[0].get("token_ids") or []
                    record.message(len(ids))

    return session.close, one


def openai_chat(base: str, workload: Workload) -> tuple[Callable[[], Awaitable[None]], OneRequest]:
    """OpenAI streaming chat (through a router): one user message of `prompt_len` words."""
    session, served_model = _openai_session(base)

    async def one(i: int, prompt: list[int], record: Record) -> None:
        body = {
            "model": await served_model(),
            "messages": [{"role": "user", "content": " ".join(f"w{t}" for t in prompt)}],
            "max_tokens": workload.output_len,
            "temperature": workload.temperature,
            "ignore_eos": True,
            "seed": i,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        seen = 0
        async with session.post(base + "/v1/chat/completions", json=body) as response:
            response.raise_for_status()
            async for chunk in _sse(response):
                usage = chunk.get("usage")
                if usage and usage.get("completion_tokens", 0) > seen:
                    record.message(usage["completion_tokens"] - seen)  # tokens not yet counted
                    seen = usage["completion_tokens"]
                for choice in chunk.get("choices") or []:
                    if (choice.get("delta") or {}).get("content"):
                        record.message(1)  # a content delta carries one token here
                        seen += 1

    return session.close, one
