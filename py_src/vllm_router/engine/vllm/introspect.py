"""Reading a vLLM class's shape without running it: parameter names, assigned attributes.

What compat.py's touch-point checks are made of (a moved name is found at start-up, not
mid-request).
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


def called_names(function: Any) -> set[str]:
    """What `function` calls, as written (`self.x.y`, `copy`), read from its source."""
    source = textwrap.dedent(inspect.getsource(function))
    return {
        ast.unparse(node.func) for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Call)
    }


def missing(have: tuple[str, ...] | set[str], want: tuple[str, ...]) -> str | None:
    absent = [name for name in want if name not in have]
    return f"lacks {', '.join(absent)}" if absent else None
