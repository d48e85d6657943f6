"""Reading a vLLM class's shape without running it: parameter names, assigned attributes.

What compat.py's touch-point checks are made of (a moved name is found at start-up, not
mid-request), and all `vllm-servicer check-vllm` has when no engine runs: what an instance
would carry is read from its class and the constructors it runs.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from typing import Any


def parameters(function: Any) -> tuple[str, ...]:
    """The parameter names of `function`, without `self`."""
    names = tuple(inspect.signature(function).parameters)
    return names[1:] if names[:1] == ("self",) else names


def assigned_attributes(cls: type) -> set[str]:
    """The `self.X` attributes `cls.__init__` assigns (read from its source)."""
    source = textwrap.dedent(inspect.getsource(cls.__init__))  # type: ignore[misc]
    return {
        target.attr
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.Assign, ast.AnnAssign))
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
        if isinstance(target, ast.Attribute)
        and isinstance(target.value, ast.Name)
        and target.value.id == "self"
    }


def attribute_names(cls: type) -> set[str]:
    """What an instance of `cls` carries, read from the class alone: its class attributes
    and what the constructor of each class in its MRO assigns (a base's `__init__`, run
    through `super().__init__`, sets attributes the subclass's source never names)."""
    names = set(dir(cls))
    # A dataclass's or msgspec struct's fields without a default are no class attributes.
    names |= set(getattr(cls, "__dataclass_fields__", ()))
    names |= set(getattr(cls, "__struct_fields__", ()))
    for klass in cls.__mro__:
        if "__init__" not in vars(klass) or klass is object:
            continue
        try:
            names |= assigned_attributes(klass)
        except (OSError, TypeError):  # a constructor without Python source (C, generated)
            continue
    return names


def called_names(function: Any) -> set[str]:
    """What `function` calls, as written (`self.x.y`, `copy`), read from its source."""
    source = textwrap.dedent(inspect.getsource(function))
    return {
        ast.unparse(node.func) for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Call)
    }


def missing(have: tuple[str, ...] | set[str], want: tuple[str, ...]) -> str | None:
    absent = [name for name in want if name not in have]
    return f"lacks {', '.join(absent)}" if absent else None


def raised(exc: Exception) -> str:
    """A check that raised, told as a mismatch: the import that failed (a vLLM module that
    moved, or one that cannot load here), else the exception."""
    if isinstance(exc, ImportError):
        return f"cannot import {exc.name or 'a vLLM module'}: {exc}"
    module = _importing(exc)
    if module is not None:  # raised by a module's own code while it was imported
        return f"cannot import {module}: {type(exc).__name__}: {exc}"
    return f"{type(exc).__name__}: {exc}"


def _importing(exc: Exception) -> str | None:
    """The module whose import `exc` interrupted: the first module-level frame below where
    it was caught (importlib's own frames are functions, a module's body is `<module>`)."""
    trace = exc.__traceback__
    while trace is not None:
        frame = trace.tb_frame
        if frame.f_code.co_name == "<module>":
            return str(frame.f_globals.get("__name__", "a module"))
        trace = trace.tb_next
    return None
