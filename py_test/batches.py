"""Helpers of the GenerateBatch tests: build requests, feed a stream, read what it says."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import AsyncIterator
from typing import Any, TypeAlias

import grpc

from vllm_router.proto import vllm_engine_pb2 as pb

from harness import request

Call: TypeAlias = grpc.aio.StreamStreamCall


def generate(
    prompt: list[int],
    request_id: str,
    timeout_ms: int = 0,
    *,
    compact: bool = False,
    traceparent: str = "",
    skip_detokenize: bool = False,
    **sampling: object,
) -> pb.GenerateBatchRequest:
    generation = request(prompt, request_id, **sampling)
    generation.skip_detokenize = skip_detokenize
    return pb.GenerateBatchRequest(
        generate=generation,
        timeout_ms=timeout_ms,
        compact_tokens=compact,
        traceparent=traceparent,
    )


class Answers:
    """What one GenerateBatch stream said, per request."""

    def __init__(self) -> None:
        self.updates: dict[str, list[pb.GenerateStreamResponse]] = defaultdict(list)
        # Admitted requests that ended in an error, and requests refused before admission.
        self.errors: dict[str, pb.RequestError] = {}
        self.refused: list[pb.RequestError] = []
        self.messages = 0
        self.per_message: list[int] = []  # requests with news in each message
        self.compact_runs = 0  # entries of the compact `tokens` columns

    def take(self, message: pb.GenerateBatchResponse) -> None:
        self.messages += 1
        runs = message.tokens
        self.per_message.append(len(message.updates) + len(runs.request_ids))
        updated = {u.request_id for u in message.updates}
        for update in message.updates:
            assert update.request_id not in self.errors, "an update after the request's error"
            self.updates[update.request_id].append(update)
        # The compact columns: a run is a request's next tokens, between its first update
        # (an earlier message) and its last (a later one), never beside its own update.
        assert len(runs.request_ids) == len(runs.token_counts) == len(set(runs.request_ids))
        assert sum(runs.token_counts) == len(runs.token_ids)
        start = 0
        for request_id, count in zip(runs.request_ids, runs.token_counts, strict=True):
            assert count > 0 and request_id not in updated, request_id
            earlier = self.updates[request_id]
            assert earlier and not earlier[-1].is_finished, request_id
            assert request_id not in self.errors, request_id
            ids = runs.token_ids[start : start + count]
            earlier.append(pb.GenerateStreamResponse(request_id=request_id, token_ids=ids))
            start += count
            self.compact_runs += 1
        for error in message.errors:
            if error.refused:
                self.refused.append(error)
            else:
                self.errors[error.request_id] = error

    def refusal(self, request_id: str) -> pb.RequestError:
        (only,) = [e for e in self.refused if e.request_id == request_id]
        return only

    def tokens(self, request_id: str) -> list[int]:
        return [t for u in self.updates[request_id] for t in u.token_ids]

    def last(self, request_id: str) -> pb.GenerateStreamResponse:
        return self.updates[request_id][-1]

    def ended(self, request_id: str) -> bool:
        if request_id in self.errors:
            return True
        updates = self.updates.get(request_id) or []
        return bool(updates) and updates[-1].is_finished


async def read_all(call: Call, answers: Answers) -> None:
    """Read to the end (with read(): a call may not mix it with iteration)."""
    while (message := await call.read()) is not grpc.aio.EOF:
        answers.take(message)


async def run_batch(stub: Any, lengths: dict[str, int], *, compact: bool) -> Answers:
    """One GenerateBatch of token-id requests (request `i`'s prompt is [100 * (i + 1)], its
    length `lengths[id]`), read to its end, which must be OK with no request's error."""
    call = stub.GenerateBatch(
        [
            generate([100 * (i + 1)], rid, max_tokens=n, skip_detokenize=True, compact=compact)
            for i, (rid, n) in enumerate(lengths.items())
        ]
    )
    answers = Answers()
    await read_all(call, answers)
    assert await call.code() == grpc.StatusCode.OK and answers.errors == {}
    return answers


async def until_ended(call: Call, answers: Answers, *request_ids: str) -> None:
    while not all(answers.ended(r) for r in request_ids):
        message = await call.read()
        assert message is not grpc.aio.EOF, "the stream ended early"
        answers.take(message)


class Requests:
    """The client side of a stream fed as a test goes: `put` messages, `put(None)` half-closes."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[pb.GenerateBatchRequest | None] = asyncio.Queue()

    async def put(self, item: pb.GenerateBatchRequest | None) -> None:
        await self._queue.put(item)

    async def stream(self) -> AsyncIterator[pb.GenerateBatchRequest]:
        while (item := await self._queue.get()) is not None:
            yield item
