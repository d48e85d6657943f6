"""vLLM's gRPC launcher with SMG's Rust servicer (`SMG_VLLM_SERVICER_IMPL=rust`), for the
`smg-rust` bench target.

smg-grpc-servicer 0.14.1 (the launcher's servicer package) hands `smg.servicer.VllmGrpcServer`
four keyword arguments that smg 1.13.0, the newest smg on PyPI, does not accept yet, and the
server then fails before the engine starts (`unexpected keyword argument
'engine_silence_timeout_secs'`). They are supervision, metrics and media settings, none on the
request path, so this launcher drops exactly those four and runs the stock launcher; the
serving is smg's own Rust code. Run as `python smg_rust_servicer.py <launcher flags>` with
`smg` 1.13.0 importable (make bench installs it under .bench/smg).
"""

from __future__ import annotations

import importlib
import os
from typing import Any

# What smg-grpc-servicer 0.14.1 passes and smg 1.13.0's VllmGrpcServer does not know.
NEWER_KEYWORDS = (
    "engine_silence_timeout_secs",
    "engine_prefill_tokens_per_sec",
    "metrics_bind_address",
    "mm_encoder_budget",
)


def main() -> None:
    import smg.servicer

    stock = smg.servicer.VllmGrpcServer

    def server(*args: Any, **kwargs: Any) -> Any:
        for name in NEWER_KEYWORDS:
            kwargs.pop(name, None)
        return stock(*args, **kwargs)

    smg.servicer.VllmGrpcServer = server  # looked up by name when the launcher builds it
    os.environ["SMG_VLLM_SERVICER_IMPL"] = "rust"
    # Imported by name (not run as __main__): smg-grpc-servicer binds its Rust switch
    # into the launcher as the launcher module loads.
    launcher = importlib.import_module("vllm.entrypoints.launchers.grpc_server")
    launcher.main()


if __name__ == "__main__":
    main()
