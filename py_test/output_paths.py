"""Which output path the real engine's requests took, seen from the tests only.

Counts `LeanStream`s made (requests on the lean path), the decode steps the fast loop
handed to them and the requests that entered the engine core directly (entry.py), by
wrapping the three methods for the duration of a `with` block; the production classes keep
no counters for this.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from vllm_router.engine.vllm.entry import DirectEntry
from vllm_router.engine.vllm.lean import LeanStream


@dataclass
class PathCounts:
    lean_streams: int = 0  # requests served without a RequestOutput per step
    fast_steps: int = 0  # decode steps taken by fast_outputs.py's loop
    direct_entries: int = 0  # requests into the engine core without AsyncLLM.add_request


@contextlib.contextmanager
def counting_paths() -> Iterator[PathCounts]:
    counts = PathCounts()
    init, plain_step = LeanStream.__init__, LeanStream.plain_step
    register = DirectEntry.register

    def counting_register(self: DirectEntry, *args: Any, **kwargs: Any) -> Any:
        request = register(self, *args, **kwargs)
        counts.direct_entries += 1
        return request

    def counting_init(self: LeanStream, *args: Any, **kwargs: Any) -> None:
        counts.lean_streams += 1
        init(self, *args, **kwargs)

    def counting_plain_step(self: LeanStream, new_token_ids: list[int]) -> None:
        counts.fast_steps += 1
        plain_step(self, new_token_ids)

    LeanStream.__init__ = counting_init  # type: ignore[method-assign]
    LeanStream.plain_step = counting_plain_step  # type: ignore[method-assign]
    DirectEntry.register = counting_register  # type: ignore[method-assign]
    try:
        yield counts
    finally:
        LeanStream.__init__ = init  # type: ignore[method-assign]
        LeanStream.plain_step = plain_step  # type: ignore[method-assign]
        DirectEntry.register = register  # type: ignore[method-assign]
