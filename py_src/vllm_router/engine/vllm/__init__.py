"""The engine protocol over vLLM's v1 AsyncLLM (imported lazily: this package imports
without vLLM). `adapter.VllmEngine` is the entry; `compat` names every vLLM internal."""

from .adapter import VllmEngine

__all__ = ["VllmEngine"]
