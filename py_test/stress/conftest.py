"""Soak and storm tests. `make test` runs them at CI scale, `make stress` (or
VLLM_SERVICER_STRESS=full) at full scale. Figures are printed at the end of the run.
"""

from __future__ import annotations

import os

FULL = os.environ.get("VLLM_SERVICER_STRESS") == "full"


def scale(ci: int, full: int) -> int:
    return full if FULL else ci
