"""WorkerClient: a typed asyncio client of one vllm.engine.v1 worker.

    async with WorkerClient("10.0.0.7:50051", api_key=key) as worker:
        async for message in worker.stream("Hello", max_tokens=32):
            print(message.text_delta, end="")

Failures surface as `client.errors.WorkerError` subclasses carrying the gRPC status.
Text prompts are tokenized here with the worker's own tokenizer (fetched once through
GetTokenizer, cached on disk by its digest, loaded without transformers: see
client.tokenizer); workers without tokenizer files (the mock) get the text and tokenize
it themselves.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ..defaults import DEFAULT_ADDRESS, DEFAULT_MAX_MESSAGE_BYTES
from ..proto import vllm_engine_pb2 as pb
from ..proto import vllm_engine_pb2_grpc as pb_grpc
from .batch import BatchStream
from .errors import UnsupportedError, from_rpc_error
from .tokenizer import ClientTokenizer, cached_tokenizer, fetch_files, load_tokenizer

Reply = TypeVar("Reply")

# Pings find a dead worker on an idle or quiet stream; never more often than the
# worker permits (--min-client-ping-interval-ms, default 500 ms), or it sends GOAWAY.
KEEPALIVE_OPTIONS = [
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]


@dataclass(frozen=True)
class Tls:
    """TLS to the worker: a CA bundle to trust, and a client certificate for mTLS."""

    ca_certs: str | None = None
    certfile: str | None = None
    keyfile: str | None = None
    server_name: str | None = None  # when the certificate names another host

    def credentials(self) -> grpc.ChannelCredentials:
        def read(path: str | None) -> bytes | None:
            return Path(path).read_bytes() if path else None

        return grpc.ssl_channel_credentials(
            root_certificates=read(self.ca_certs),
            private_key=read(self.keyfile),
            certificate_chain=read(self.certfile),
        )


def _bearer(key: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),) if key else ()


class WorkerClient:
    """One channel to one worker (TCP `address` or unix socket `uds`)."""

    def __init__(
        self,
        address: str = DEFAULT_ADDRESS,
        *,
        uds: str | None = None,
        api_key: str | None = None,
        control_api_key: str | None = None,
        tls: Tls | None = None,
        timeout: float | None = 30.0,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        """`timeout` bounds every call but generation (which runs as long as it takes).
        `api_key` goes with every call; `control_api_key` with the calls that change the
        worker (ResetPrefixCache), and with the others when no `api_key` is given (the
        control key passes the API-key check too)."""
        target = f"unix:{uds}" if uds else address
        options: list[tuple[str, Any]] = [
            *KEEPALIVE_OPTIONS,
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
        ]
        if tls is not None and tls.server_name:
            options.append(("grpc.ssl_target_name_override", tls.server_name))
        if tls is None:
            self._channel = grpc.aio.insecure_channel(target, options=options)
        else:
            self._channel = grpc.aio.secure_channel(target, tls.credentials(), options=options)
        self._stub = pb_grpc.VllmEngineStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._metadata = _bearer(api_key or control_api_key)
        self._control_metadata = _bearer(control_api_key or api_key)
        self._timeout = timeout
        self._tokenizer: ClientTokenizer | None = None
        self._tokenizer_sha256: str | None = None
        self.target = target

    async def __aenter__(self) -> WorkerClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def _call(self, call: Awaitable[Reply]) -> Reply:
        try:
            return await call
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from None

    # -- worker state -----------------------------------------------------------------------------

    async def health(self, service: str = "") -> bool:
        """grpc.health.v1 (no API key needed): True when SERVING."""
        request = health_pb2.HealthCheckRequest(service=service)
        reply = await self._call(self._health.Check(request, timeout=self._timeout))
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    async def model_info(self) -> pb.GetModelInfoResponse:
        return await self._call(
            self._stub.GetModelInfo(
                pb.GetModelInfoRequest(), metadata=self._metadata, timeout=self._timeout
            )
        )

    async def loads(self) -> pb.GetLoadsResponse:
        return await self._call(
            self._stub.GetLoads(
                pb.GetLoadsRequest(), metadata=self._metadata, timeout=self._timeout
            )
        )

    async def abort(self, *request_ids: str) -> list[str]:
        """Abort requests in flight; returns those that were."""
        reply = await self._call(
            self._stub.Abort(
                pb.AbortRequest(request_ids=request_ids),
                metadata=self._metadata,
                timeout=self._timeout,
            )
        )
        return list(reply.aborted_request_ids)

    async def reset_prefix_cache(self) -> bool:
        reply = await self._call(
            self._stub.ResetPrefixCache(
                pb.ResetPrefixCacheRequest(),
                metadata=self._control_metadata,
                timeout=self._timeout,
            )
        )
        return reply.success

    # -- tokens -----------------------------------------------------------------------------------

    async def tokenizer(self) -> ClientTokenizer:
        """The worker's tokenizer (as its vLLM tokenizes), from the disk cache or fetched once."""
        if self._tokenizer is None:
            digest = await self._tokenizer_digest()
            if not digest:
                raise UnsupportedError(grpc.StatusCode.UNIMPLEMENTED, "the worker has no tokenizer")
            directory = cached_tokenizer(digest)
            if directory is None:
                call = self._stub.GetTokenizer(
                    pb.GetTokenizerRequest(), metadata=self._metadata, timeout=self._timeout
                )
                try:
                    _, directory = await fetch_files(call.__aiter__())
                except grpc.aio.AioRpcError as exc:
                    raise from_rpc_error(exc) from None
            self._tokenizer = await asyncio.to_thread(load_tokenizer, directory)
        return self._tokenizer

    async def _tokenizer_digest(self) -> str:
        if self._tokenizer_sha256 is None:
            self._tokenizer_sha256 = (await self.model_info()).tokenizer_sha256
        return self._tokenizer_sha256

    async def tokenize(self, text: str) -> list[int]:
        """Token ids as the worker would make them (special tokens added, as vLLM does)."""
        return (await self.tokenizer()).encode(text)

    async def chat_prompt(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """Token ids of a chat rendered with the model's own chat template (as a router
        renders it), ending with the assistant's turn."""
        tokenizer = await self.tokenizer()
        if not tokenizer.chat_template:
            raise UnsupportedError(grpc.StatusCode.UNIMPLEMENTED, "the model has no chat template")
        rendered = tokenizer.render_chat(messages, add_generation_prompt=True)
        # The template writes the special tokens itself (apply_chat_template's tokenize=True
        # encodes with add_special_tokens=False too, as vLLM does).
        return tokenizer.encode(rendered, add_special_tokens=False)

    async def encode_prompt(self, prompt: str | Sequence[int]) -> str | list[int]:
        """The prompt as the worker should get it: token ids, or the text itself when the
        worker has no tokenizer files to share (it then tokenizes the text)."""
        if not isinstance(prompt, str):
            return list(prompt)
        return await self.tokenize(prompt) if await self._tokenizer_digest() else prompt

    async def _request(
        self,
        prompt: str | Sequence[int],
        request_id: str,
        skip_detokenize: bool,
        sampling: dict[str, Any],
    ) -> pb.GenerateRequest:
        request = pb.GenerateRequest(
            request_id=request_id,
            skip_detokenize=skip_detokenize,
            sampling_params=pb.SamplingParams(**sampling),
        )
        encoded = await self.encode_prompt(prompt)
        if isinstance(encoded, str):
            request.prompt_text = encoded
        else:
            request.prompt_token_ids.extend(encoded)
        return request

    # -- generation -------------------------------------------------------------------------------

    async def generate(
        self,
        prompt: str | Sequence[int],
        *,
        request_id: str = "",
        skip_detokenize: bool = False,
        timeout: float | None = None,
        **sampling: Any,
    ) -> pb.GenerateResponse:
        """One answer; `sampling` are SamplingParams fields (max_tokens=, temperature=, ...)."""
        request = await self._request(prompt, request_id, skip_detokenize, sampling)
        return await self._call(
            self._stub.Generate(request, metadata=self._metadata, timeout=timeout)
        )

    async def stream(
        self,
        prompt: str | Sequence[int],
        *,
        request_id: str = "",
        skip_detokenize: bool = False,
        timeout: float | None = None,
        **sampling: Any,
    ) -> AsyncIterator[pb.GenerateStreamResponse]:
        """Messages as the engine produces them; leaving the loop early cancels the request."""
        request = await self._request(prompt, request_id, skip_detokenize, sampling)
        call = self._stub.GenerateStream(request, metadata=self._metadata, timeout=timeout)
        try:
            async for message in call:
                yield message
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from None
        finally:
            call.cancel()  # no-op once finished; otherwise the worker stops decoding

    def batch(self, *, timeout: float | None = None, compact: bool = True) -> BatchStream:
        """One GenerateBatch stream for many requests (`async with`; see client.batch);
        `compact`: decode steps in the response's token columns (the worker's cheaper
        shape; the iterators yield the same messages either way)."""
        return BatchStream(self._stub, self._request, self._metadata, timeout, compact)
