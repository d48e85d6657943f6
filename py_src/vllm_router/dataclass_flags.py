"""Command-line flags derived from a settings dataclass, as vLLM derives its engine flags.

Field `name` becomes `--<prefix><name>` (underscores to dashes) with the field's
default and type; help, an environment-variable default, the value's placeholder and the
values it accepts come from the field's metadata (`help`, `env`, `metavar`, `choices`).
A `tuple[X, ...]` field takes one or more values (`nargs="+"`; from its variable,
separated by the field's `env_separator`, a comma by default). A variable that is set
counts even when empty. A value is declared once, in the dataclass.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from typing import Any, TypeVar

Settings = TypeVar("Settings")


def _value_type(hint: Any) -> tuple[type, bool]:
    """int, float, str or bool from a type hint such as `str | None`, and whether the
    setting holds several of them (`tuple[str, ...]`)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        (hint,) = [arg for arg in typing.get_args(hint) if arg is not type(None)]
    many = typing.get_origin(hint) is tuple
    if many:
        item, ellipsis = typing.get_args(hint)
        if ellipsis is not Ellipsis:
            raise TypeError(f"no command-line form for a {hint!r} setting")
        hint = item
    if hint not in (int, float, str, bool) or (many and hint is bool):
        raise TypeError(f"no command-line form for a {hint!r} setting")
    return hint, many


def add_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    settings: type,
    *,
    prefix: str = "",
    skip: frozenset[str] = frozenset(),
) -> None:
    """Add one flag per field of the dataclass `settings`, except the names in `skip`."""
    hints = typing.get_type_hints(settings)
    for field in dataclasses.fields(settings):
        if field.name in skip:
            continue
        flag = "--" + (prefix + field.name).replace("_", "-")
        kind, many = _value_type(hints[field.name])
        default = field.default
        env = field.metadata.get("env")
        help_text = field.metadata.get("help", "")
        if env:
            # Set is set, even empty: a secret that did not arrive must not read as "none".
            if env in os.environ:
                separator = field.metadata.get("env_separator", ",")
                default = _from_env(os.environ[env], many, separator)
            help_text = f"{help_text} (default: ${env})"
        elif kind is not bool and default is not None:
            help_text = f"{help_text} (default: {default})".lstrip()
        dest = prefix.replace("-", "_") + field.name
        if kind is bool:
            parser.add_argument(
                flag, dest=dest, action=argparse.BooleanOptionalAction, default=default,
                help=help_text or None,
            )  # fmt: skip
        else:
            parser.add_argument(
                flag, dest=dest, type=kind, default=default, help=help_text or None,
                nargs="+" if many else None, metavar=field.metadata.get("metavar"),
                choices=field.metadata.get("choices"),
            )  # fmt: skip


def _from_env(value: str, many: bool, separator: str) -> Any:
    """A variable's text as the flag's default: for a setting that holds several, its items
    split at `separator` (empty items dropped; an empty variable is an empty tuple)."""
    if not many:
        return value
    return tuple(item for item in value.split(separator) if item)


def from_args(settings: type[Settings], args: argparse.Namespace, *, prefix: str = "") -> Settings:
    """The dataclass `settings` filled from parsed `args` (fields without a flag keep defaults)."""
    dest_prefix = prefix.replace("-", "_")
    values = {
        field.name: getattr(args, dest_prefix + field.name)
        for field in dataclasses.fields(settings)  # type: ignore[arg-type]
        if hasattr(args, dest_prefix + field.name)
    }
    # argparse gives several values as a list; the settings hold a tuple.
    values = {name: tuple(v) if isinstance(v, list) else v for name, v in values.items()}
    return settings(**values)
