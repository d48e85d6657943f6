"""What every contract reads from a request the same way: ids, trace context, the DP rank.

Each contract names its own fields (our `dp_rank`, vLLM's `data_parallel_rank`), so
the checks take the field name for their messages; the rules are declared here once.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence

from ..engine import ModelFacts
from ..errors import InvalidRequest

# A request id is echoed on every message and kept in the request table.
MAX_REQUEST_ID_BYTES = 256

# Call-metadata keys whose values reach the engine as W3C trace context.
TRACE_HEADERS = ("traceparent", "tracestate")


def new_request_id() -> str:
    return uuid.uuid4().hex


def checked_request_id(request_id: str) -> str:
    """The caller's id (or a new one when empty), within the length limit."""
    request_id = request_id or new_request_id()
    size = len(request_id.encode())
    if size > MAX_REQUEST_ID_BYTES:
        raise InvalidRequest(
            f"request_id is {size} bytes; at most {MAX_REQUEST_ID_BYTES} are allowed"
        )
    return request_id


def trace_headers(metadata: Sequence[tuple[str, str | bytes]] | None) -> dict[str, str] | None:
    """The W3C trace context in a call's metadata, if any."""
    found = {
        key: value if isinstance(value, str) else value.decode(errors="replace")
        for key, value in metadata or ()
        if key in TRACE_HEADERS
    }
    return found or None


def checked_dp_rank(rank: int | None, facts: ModelFacts, field_name: str) -> int | None:
    """A data-parallel rank the engine has (None: the engine chooses)."""
    if rank is not None and not 0 <= rank < facts.dp_size:
        raise InvalidRequest(
            f"{field_name} {rank} is out of range: this engine has dp_size {facts.dp_size} "
            f"(--data-parallel-size; valid ranks 0..{facts.dp_size - 1})"
        )
    return rank
