"""BatchStream: many requests over one GenerateBatch stream, each read as its own stream.

    async with worker.batch() as batch:
        async for message in batch.stream([1, 2, 3], max_tokens=32):
            ...

Requests started on one BatchStream share one HTTP/2 stream and get one message per
engine step for all of them (see the proto's GenerateBatchRequest); each `stream(...)` iterator
sees only its own request's messages, exactly those GenerateStream would send, and
raises its own request's error as the `WorkerError` GenerateStream would have raised.
Leaving an iterator early aborts that request; closing the BatchStream aborts all.

With `compact` (the default) the requests ask for their plain decode steps in the
response's `tokens` columns (GenerateBatchRequest.compact_tokens), which costs the
worker less per token; each iterator still yields GenerateStream's messages (token ids
and usage; such a message carries nothing else).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import grpc

from ..errors import status_code
from ..proto import vllm_engine_pb2 as pb
from ..proto import vllm_engine_pb2_grpc as pb_grpc
from .errors import AlreadyExistsError, UnavailableError, WorkerError, from_rpc_error, from_status

# What a request's inbox receives: its messages, then possibly the error that ended it.
Inbox = asyncio.Queue[pb.GenerateStreamResponse | WorkerError]
# WorkerClient's request builder: (prompt, request_id, skip_detokenize, sampling).
BuildRequest = Callable[
    [str | Sequence[int], str, bool, dict[str, Any]], Awaitable[pb.GenerateRequest]
]


class BatchStream:
    """One GenerateBatch call; `stream` runs a request on it (open with `WorkerClient.batch`)."""

    def __init__(
        self,
        stub: pb_grpc.VllmEngineStub,
        build: BuildRequest,
        metadata: Any,
        timeout: float | None = None,
        compact: bool = True,
    ) -> None:
        """`timeout` bounds the whole stream (every request on it); None: no bound."""
        self._build = build
        self._compact = compact
        self._outgoing: asyncio.Queue[pb.GenerateBatchRequest | None] = asyncio.Queue()
        self._inboxes: dict[str, Inbox] = {}
        self._ended: WorkerError | None = None
        self._call = stub.GenerateBatch(self._requests(), metadata=metadata, timeout=timeout)
        self._reader = asyncio.create_task(self._read(), name="batch-reader")

    async def _requests(self) -> AsyncIterator[pb.GenerateBatchRequest]:
        while (item := await self._outgoing.get()) is not None:
            yield item

    async def _read(self) -> None:
        try:
            while (message := await self._call.read()) is not grpc.aio.EOF:
                for update in message.updates:
                    inbox = self._inboxes.get(update.request_id)
                    if inbox is not None:
                        inbox.put_nowait(update)
                runs = message.tokens
                if runs.request_ids:
                    self._deliver_runs(runs)
                for error in message.errors:
                    inbox = self._inboxes.get(error.request_id)
                    if inbox is not None:
                        inbox.put_nowait(from_status(status_code(error.code), error.message))
            self._ended = UnavailableError(grpc.StatusCode.UNAVAILABLE, "the batch stream ended")
        except grpc.aio.AioRpcError as exc:
            self._ended = from_rpc_error(exc)
        except asyncio.CancelledError:
            if not self._call.cancelled():
                raise
            # close_now: the call was cancelled under the read.
        finally:
            ended = self._ended or WorkerError(grpc.StatusCode.CANCELLED, "the stream was closed")
            for inbox in self._inboxes.values():
                inbox.put_nowait(ended)

    def _deliver_runs(self, runs: pb.TokenRuns) -> None:
        """Each request's run of new token ids, as a message without usage (see `run`)."""
        token_ids = runs.token_ids
        start = 0
        for request_id, count in zip(runs.request_ids, runs.token_counts, strict=True):
            inbox = self._inboxes.get(request_id)
            if inbox is not None:
                ids = token_ids[start : start + count]
                inbox.put_nowait(pb.GenerateStreamResponse(request_id=request_id, token_ids=ids))
            start += count

    async def stream(
        self,
        prompt: str | Sequence[int],
        *,
        request_id: str = "",
        skip_detokenize: bool = False,
        timeout: float | None = None,
        **sampling: Any,
    ) -> AsyncIterator[pb.GenerateStreamResponse]:
        """As `WorkerClient.stream`, on this stream; `timeout` bounds this request alone."""
        request = await self._build(
            prompt, request_id or uuid.uuid4().hex, skip_detokenize, sampling
        )
        async for message in self.run(request, timeout=timeout):
            yield message

    async def run(
        self, request: pb.GenerateRequest, *, timeout: float | None = None
    ) -> AsyncIterator[pb.GenerateStreamResponse]:
        """Run a request built already (request_id set) and yield its messages."""
        if self._ended is not None:
            raise self._ended
        request_id = request.request_id
        if request_id in self._inboxes:
            raise AlreadyExistsError(
                grpc.StatusCode.ALREADY_EXISTS, f"{request_id!r} already runs on this stream"
            )
        inbox: Inbox = asyncio.Queue()
        self._inboxes[request_id] = inbox
        timeout_ms = max(1, round(timeout * 1000)) if timeout else 0
        self._outgoing.put_nowait(
            pb.GenerateBatchRequest(
                generate=request, timeout_ms=timeout_ms, compact_tokens=self._compact
            )
        )
        samples = max(1, request.sampling_params.n) if request.sampling_params.HasField("n") else 1
        finished = 0
        usage = pb.Usage()  # the latest, for the compact runs (which carry none)
        try:
            while finished < samples:
                item = await inbox.get()
                if isinstance(item, WorkerError):
                    raise item
                if item.HasField("usage"):
                    usage = item.usage
                else:
                    item.usage.CopyFrom(usage)
                    item.usage.completion_tokens += len(item.token_ids)
                    usage = item.usage
                finished += item.is_finished
                yield item
        finally:
            del self._inboxes[request_id]
            if finished < samples and self._ended is None:
                abort = pb.AbortRequest(request_ids=[request_id])
                self._outgoing.put_nowait(pb.GenerateBatchRequest(abort=abort))

    async def close(self) -> None:
        """No more requests; wait for the ones running (cancel them all if interrupted)."""
        self._outgoing.put_nowait(None)
        try:
            await self._reader
        finally:
            self._call.cancel()
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader

    async def close_now(self) -> None:
        """Leave at once: the worker aborts every request still on the stream."""
        self._call.cancel()
        await self.close()

    async def __aenter__(self) -> BatchStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        if exc[0] is not None:
            await self.close_now()
        else:
            await self.close()
