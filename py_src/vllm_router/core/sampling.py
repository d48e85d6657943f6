"""Sampling fields read from any contract's message into the one `SamplingOptions` declaration.

A contract's sampling message is read field by field by name: every `SamplingOptions`
field with a same-named proto field is converted by the same rule (repeated -> tuple,
map -> dict or None, a field with presence -> its value or None when unset, a plain
proto3 scalar -> its value). A contract declares only what differs: fields it converts
itself (`special`) and the value that stands for an unset or zero field (`fallbacks`).
`covered` is what the table reads, so a test can require every proto field to be read
or refused: a field added to either proto cannot be silently ignored.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from ..engine import SamplingOptions

_REPEATED, _MAP, _PRESENCE, _PLAIN = range(4)


def _kind(field: FieldDescriptor) -> int:
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        return _MAP
    if field.is_repeated:
        return _REPEATED
    return _PRESENCE if field.has_presence else _PLAIN


class SamplingTable:
    """How one contract's sampling message becomes `SamplingOptions`."""

    def __init__(
        self,
        descriptor: Descriptor,
        *,
        special: Mapping[str, Callable[[Any], Any]] | None = None,
        fallbacks: Mapping[str, Any] | None = None,
    ) -> None:
        self._special = dict(special or {})
        self._fallbacks = dict(fallbacks or {})
        proto_fields = descriptor.fields_by_name
        self._fields = tuple(
            (f.name, _kind(proto_fields[f.name]))
            for f in dataclasses.fields(SamplingOptions)
            if f.name in proto_fields and f.name not in self._special
        )
        unknown = set(self._special) - {f.name for f in dataclasses.fields(SamplingOptions)}
        if unknown:
            raise ValueError(f"special converters for fields SamplingOptions lacks: {unknown}")
        # Proto fields this table reads, itself or through a same-named special converter.
        self.covered = frozenset(name for name, _ in self._fields) | (
            self._special.keys() & proto_fields.keys()
        )

    def read(self, params: Message) -> SamplingOptions:
        values: dict[str, Any] = {}
        for name, kind in self._fields:
            value: Any = getattr(params, name)
            if kind == _REPEATED:
                value = tuple(value)
            elif kind == _MAP:
                value = dict(value) or None
            elif kind == _PRESENCE and not params.HasField(name):
                value = None
            if name in self._fallbacks and (value is None or (kind == _PLAIN and not value)):
                value = self._fallbacks[name]
            values[name] = value
        for name, convert in self._special.items():
            values[name] = convert(params)
        return SamplingOptions(**values)
