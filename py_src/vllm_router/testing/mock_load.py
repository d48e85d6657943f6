"""The mock engine's load figures: what its scheduler holds, in total and per DP rank.

A request pinned to a data-parallel rank (`dp_rank`) runs on that rank; an unpinned one
on rank 0. Every rank of the mock reports from the start (it has no engine cores that
are still starting), so its figures are never unknown.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Protocol

from ..engine import GenerationRequest, LoadSnapshot, RankLoad


class Held(Protocol):
    """What the mock knows of a request it holds."""

    request: GenerationRequest
    prompt: list[int]
    running: bool
    generated: int


def load_of(held: Iterable[Held], kv_cache_tokens: int) -> LoadSnapshot:
    states = list(held)
    running = [r for r in states if r.running]
    used = sum(len(r.prompt) + r.generated for r in running)
    return LoadSnapshot(
        running_requests=len(running),
        waiting_requests=len(states) - len(running),
        kv_cache_usage=min(1.0, used / kv_cache_tokens),
    )


def rank_loads(held: Iterable[Held], kv_cache_tokens: int, dp_size: int) -> list[RankLoad]:
    states = list(held)
    now = time.time()
    ranks = []
    for rank in range(dp_size):
        load = load_of((r for r in states if (r.request.dp_rank or 0) == rank), kv_cache_tokens)
        ranks.append(
            RankLoad(rank, load.running_requests, load.waiting_requests, load.kv_cache_usage, now)
        )
    return ranks
