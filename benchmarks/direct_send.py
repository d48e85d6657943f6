"""What a direct send costs us per message on --transport native, beside the transport's own.

Times the server's per-stream transport send (`transport_send`: what it needs looked up once)
and the general one it replaced (`direct_send`: upstream's encoder, three calls deep) over a
front whose `stream_try_send` takes every message at once, so what is printed is the Python
around the FFI call: a native-contract decode step's message, encoded and handed over.
Prints microseconds per message for both (median of 5 runs).
"""

from __future__ import annotations

import functools
import statistics
import time
import types
from collections.abc import Callable
from typing import Any

MESSAGES = 500_000


def _per_message_us(send: Callable[[Any], bool], message: Any) -> float:
    runs = []
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(MESSAGES):
            send(message)
        runs.append((time.perf_counter() - started) * 1e6 / MESSAGES)
    return statistics.median(runs)


def main() -> None:
    import pygrpc_native

    from vllm_router.proto import vllm_native_pb2 as npb
    from vllm_router.server.transport import _native_module, _polling_send_server

    server_class = _polling_send_server(_native_module())
    server: Any = object.__new__(server_class)
    taken = pygrpc_native.STREAM_SENT

    class Front:
        def stream_try_send(self, call_id: int, data: bytes) -> int:
            return taken

    server._front, server._send_limit = Front(), 4 << 20
    handler = types.SimpleNamespace(response_serializer=npb.GenerateResponse.SerializeToString)
    call = types.SimpleNamespace(call_id=1, handler=handler)
    context = types.SimpleNamespace(_closed=False)
    # A plain step's message as the native contract's direct-step renderer makes it.
    output = npb.SequenceOutput(index=0, num_tokens=1)
    output.token_ids.extend([1234])
    message = npb.GenerateResponse(outputs=output)
    general = functools.partial(server.try_send, call, context)
    per_stream = server.transport_send(call, context)
    print(f"general direct send:    {_per_message_us(general, message):.2f} µs per message")
    print(f"per-stream direct send: {_per_message_us(per_stream, message):.2f} µs per message")


if __name__ == "__main__":
    main()
