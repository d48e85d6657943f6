"""The gRPC contracts this worker serves, one package each, over one serving core.

Every contract package has the same shape: `servicer.py` (thin handlers),
`convert.py` (request messages -> the engine's neutral types, pure functions) and
`responses.py` (neutral types -> response messages, pure functions). No contract
imports another: what they share lives in `vllm_router.core`. The server mounts them
from one registry (`vllm_router.server.registry`).
"""
