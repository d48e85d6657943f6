"""What every contract reads from a request the same way: ids, trace context, the DP rank.

Each contract names its own fields (our `dp_rank`, vLLM's `data_parallel_rank`), so
the checks take the field name for their messages; the rules are declared here once.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence

from ..engine import ModelFacts
from ..errors import InvalidRequest

# A request id is echoed on every message and kept in the request table.
MAX_REQUEST_ID_BYTES = 256

# Call-metadata keys whose values reach the engine as W3C trace context.
TRACE_HEADERS = ("traceparent", "tracestate")
# W3C trace context's traceparent: version 00, a trace id and a parent id not all zeros.
TRACEPARENT = re.compile(r"00-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}")


def new_request_id() -> str:
    """128 random bits as 32 hex digits, the shape of `uuid.uuid4().hex` without building
    a UUID object: a fifth of its cost, paid by every request that names no id."""
    return os.urandom(16).hex()


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


def request_trace(
    traceparent: str, stream_trace: Mapping[str, str] | None, field_name: str
) -> Mapping[str, str] | None:
    """A request's own trace context when it names one, else its stream's."""
    if not traceparent:
        return stream_trace
    if not TRACEPARENT.fullmatch(traceparent):
        raise InvalidRequest(
            f"{field_name} {traceparent[:80]!r} is not a W3C traceparent "
            "(00-<32 hex trace id>-<16 hex parent id>-<2 hex flags>, lower case, not all zeros)"
        )
    return {"traceparent": traceparent}


def checked_dp_rank(rank: int | None, facts: ModelFacts, field_name: str) -> int | None:
    """A data-parallel rank the engine has (None: the engine chooses)."""
    if rank is not None and not 0 <= rank < facts.dp_size:
        raise InvalidRequest(
            f"{field_name} {rank} is out of range: this engine has dp_size {facts.dp_size} "
            f"(--data-parallel-size; valid ranks 0..{facts.dp_size - 1})"
        )
    return rank
