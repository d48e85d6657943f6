"""Console entry of `vllm-servicer-client` (the commands are in `client.cli`).

gRPC's C core prints its own raw line for a failed TLS handshake beside the one
clear line the CLI prints; its verbosity is read when gRPC loads, so it is set first.
"""

from __future__ import annotations

import os


def main() -> None:
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    from .client.cli import main as run

    run()
