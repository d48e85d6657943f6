"""vLLM's KV-cache event publisher (ZMQ, `--kv-events-config`) read as neutral batches.

vLLM's engine core publishes each step's prefix-cache changes as a msgpack
`KVEventBatch` in a ZMQ multipart message (topic, 8-byte sequence number, payload).
Each subscriber gets its own SUB socket; hashes become signed 64-bit integers.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

from ...errors import NotConfigured
from ..types import KvBlocksRemoved, KvBlocksStored, KvCacheCleared, KvEventBatch, KvEventSource

NOT_ENABLED = (
    "KV cache events are not published by this engine: start it with --kv-events-config "
    '\'{"enable_kv_cache_events": true, "publisher": "zmq"}\''
)


def _binds(endpoint: str) -> bool:
    """vLLM's publisher rule, for a vLLM whose own helper moved (see compat.py)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def _publishes(config: Any) -> bool:
    return config is not None and config.enable_kv_cache_events and config.publisher == "zmq"


def _rank_endpoint(endpoint: str, dp_rank: int, vllm_bind_rule: bool) -> str | None:
    """`endpoint` moved to a DP rank's port, as vLLM's publisher moves it (None: unknown)."""
    if vllm_bind_rule:
        from vllm.distributed.kv_events import ZmqEventPublisher

        return str(ZmqEventPublisher.offset_endpoint_port(endpoint, dp_rank))
    return endpoint if dp_rank == 0 else None


def zmq_endpoint(config: Any, dp_rank: int = 0, *, vllm_bind_rule: bool = True) -> str:
    """Where a subscriber connects: vLLM's bind endpoint, with `*` as loopback, per DP rank.

    vLLM's publisher binds wildcard and ipc endpoints and connects to any other (a remote
    collector): only a bound publisher can be subscribed to from here.
    """
    if not _publishes(config):
        raise NotConfigured(NOT_ENABLED)
    endpoint = _rank_endpoint(str(config.endpoint), dp_rank, vllm_bind_rule)
    if endpoint is None:
        raise NotConfigured("this vLLM's per-rank KV event endpoints are unknown to this worker")
    if vllm_bind_rule:
        from vllm.distributed.kv_events import ZmqEventPublisher

        binds = ZmqEventPublisher._is_bind_endpoint(endpoint)
    else:
        binds = _binds(endpoint)
    if not binds:
        raise NotConfigured(
            f"vLLM publishes KV cache events to the collector at {endpoint}; to subscribe "
            "through this worker give --kv-events-config a bind endpoint (tcp://*:PORT or ipc://)"
        )
    return endpoint.replace("*", "127.0.0.1")


def to_int64(block_hash: bytes | int) -> int:
    """A block hash as the signed 64-bit integer the wire carries."""
    if isinstance(block_hash, bytes):
        return int.from_bytes(block_hash[:8], "big", signed=True)
    return (block_hash + 2**63) % 2**64 - 2**63


def _event(event: Any) -> KvBlocksStored | KvBlocksRemoved | KvCacheCleared:
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    if isinstance(event, BlockStored):
        parent = event.parent_block_hash
        return KvBlocksStored(
            block_hashes=tuple(to_int64(h) for h in event.block_hashes),
            parent_block_hash=None if parent is None else to_int64(parent),
            token_ids=tuple(event.token_ids),
            block_size=event.block_size,
            lora_id=event.lora_id,
        )
    if isinstance(event, BlockRemoved):
        return KvBlocksRemoved(block_hashes=tuple(to_int64(h) for h in event.block_hashes))
    return KvCacheCleared()


async def kv_event_batches(
    config: Any, topic: str = "", *, dp_size: int = 1, vllm_bind_rule: bool = True
) -> AsyncGenerator[KvEventBatch, None]:
    """Batches from every DP rank's publisher (one SUB socket connected to each; a batch
    names its rank), from now on, until the consumer stops."""
    import msgspec
    import zmq
    import zmq.asyncio
    from vllm.distributed.kv_events import KVEventBatch as VllmBatch

    endpoints = [
        zmq_endpoint(config, rank, vllm_bind_rule=vllm_bind_rule) for rank in range(dp_size)
    ]
    decoder = msgspec.msgpack.Decoder(type=VllmBatch)
    context = zmq.asyncio.Context.instance()
    socket = context.socket(zmq.SUB)
    try:
        for endpoint in endpoints:
            socket.connect(endpoint)
        socket.setsockopt_string(zmq.SUBSCRIBE, topic)
        while True:
            _, sequence, payload = await socket.recv_multipart()
            batch = decoder.decode(payload)
            yield KvEventBatch(
                sequence=int.from_bytes(sequence, "big"),
                timestamp=batch.ts,
                dp_rank=batch.data_parallel_rank,
                events=tuple(_event(e) for e in batch.events),
            )
    finally:
        socket.close(linger=0)


def kv_event_sources(config: Any, dp_size: int, *, vllm_bind_rule: bool) -> list[KvEventSource]:
    """The engine's publishers, one per DP rank, as the engine is configured (a wildcard host
    stays a wildcard: a subscriber puts the worker's host there, as with vllm-rs); none when
    events are off, published by something other than ZMQ, or on ranks unknown here."""
    if not _publishes(config):
        return []
    endpoints = [_rank_endpoint(str(config.endpoint), r, vllm_bind_rule) for r in range(dp_size)]
    replay = getattr(config, "replay_endpoint", None)
    return [
        KvEventSource(
            endpoint=endpoint,
            topic=getattr(config, "topic", "") or "",
            dp_rank=rank,
            replay_endpoint=(_rank_endpoint(str(replay), rank, vllm_bind_rule) or "")
            if replay
            else "",
            buffer_steps=int(getattr(config, "buffer_steps", 0) or 0),
            hwm=int(getattr(config, "hwm", 0) or 0),
            max_queue_size=int(getattr(config, "max_queue_size", 0) or 0),
        )
        for rank, endpoint in enumerate(endpoints)
        if None not in endpoints and endpoint is not None
    ]
