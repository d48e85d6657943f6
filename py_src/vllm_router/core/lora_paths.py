"""Where a LoRA adapter a remote caller names may be loaded from: the rule of vLLM's Rust
front end (vllm-rs 0.34, `validate_lora_path_access`), on every contract's LoRA load.

- A name is a local path when it is absolute, starts with `~` or `.`, has a `..` part, or
  exists relative to the worker's directory; anything else is a model hub id.
- Local paths need allowed prefixes (`--lora-allowed-path-prefixes`, or vllm-rs's
  `$VLLM_RUNTIME_LORA_ALLOWED_PATH_PREFIXES`, `:`-separated); with none, every local path is
  refused. A local path must be absolute, and once its links and `..` are resolved it must
  lie under a prefix (whole path parts: `/data/lora` does not cover `/data/lora2`). The
  engine is given the resolved path, and lists it.
- Hub ids go to the engine as they are (vLLM downloads them), unless `--no-lora-hub-ids`.

The statuses and messages are vllm-rs's (INVALID_ARGUMENT; NOT_FOUND for an adapter that is
missing under a prefix), with one difference: vllm-rs resolves the path before it compares
it, so a missing path outside every prefix answers "No adapter found" and an existing one
"outside"; here a path outside every prefix is "outside" whether it exists or not.
Startup-time `--lora-modules` are the operator's own and are not checked (as in vllm-rs).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import InvalidRequest, NotFound

PREFIXES_ENV = "VLLM_RUNTIME_LORA_ALLOWED_PATH_PREFIXES"
NO_PREFIXES = f"Local LoRA adapter paths require {PREFIXES_ENV} to be configured."
NOT_ABSOLUTE = (
    f"Local LoRA adapter paths must be absolute and under one of the prefixes configured by "
    f"{PREFIXES_ENV}."
)
INACCESSIBLE = "Local LoRA adapter path must exist and be accessible."
OUTSIDE = "Local LoRA adapter path is outside the configured allowed prefixes."
NO_HUB = (
    "LoRA adapters from a model hub are not loaded on this worker (--no-lora-hub-ids): name a "
    f"local path under one of the prefixes configured by {PREFIXES_ENV}"
)


class PrefixError(ValueError):
    """A configured prefix that is not an existing directory (a start-up error)."""


def _looks_local(path: str) -> bool:
    return (
        os.path.isabs(path)
        or path.startswith(("~", "."))
        or ".." in path.split(os.sep)
        or os.path.lexists(path)
    )


def _under(path: str, prefix: str) -> bool:
    return os.path.commonpath([prefix, path]) == prefix


@dataclass(frozen=True)
class LoraPathRule:
    """The rule above, its prefixes resolved once at start."""

    prefixes: tuple[str, ...] = ()
    hub_ids: bool = True

    @classmethod
    def of(cls, prefixes: Sequence[str] | None, *, hub_ids: bool = True) -> LoraPathRule:
        """Checked at start (PrefixError): every prefix an existing directory, resolved."""
        resolved = []
        for prefix in prefixes or ():
            if not prefix:
                continue  # empty entries are dropped, as vllm-rs drops them
            if not os.path.isabs(prefix) or not os.path.isdir(prefix):
                raise PrefixError(
                    f"LoRA path prefix {prefix!r} is not an absolute path to an existing directory"
                )
            resolved.append(os.path.realpath(prefix))
        return cls(tuple(resolved), hub_ids)

    def check(self, path: str) -> str:
        """The path to give the engine for a caller's `path`, or the refusal (raised)."""
        if not _looks_local(path):
            if not self.hub_ids:
                raise InvalidRequest(NO_HUB)
            return path
        if not self.prefixes:
            raise InvalidRequest(NO_PREFIXES)
        if not os.path.isabs(path):
            raise InvalidRequest(NOT_ABSOLUTE)
        where = os.path.realpath(path)  # links and `..` resolved, existing or not
        if not any(_under(where, prefix) for prefix in self.prefixes):
            raise InvalidRequest(OUTSIDE)
        try:
            resolved = os.path.realpath(path, strict=True)
        except FileNotFoundError:
            raise NotFound(f"No adapter found for {path}") from None
        except OSError:
            raise InvalidRequest(INACCESSIBLE) from None
        if not any(_under(resolved, prefix) for prefix in self.prefixes):  # moved meanwhile
            raise InvalidRequest(OUTSIDE)
        return resolved
