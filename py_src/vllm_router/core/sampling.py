"""Sampling fields read from any contract's message into the one `SamplingOptions` declaration.

A contract's sampling message is read field by field by name: every `SamplingOptions`
field with a same-named proto field is converted by the same rule (repeated -> tuple,
map -> dict or None, a field with presence -> its value or None when unset, a plain
proto3 scalar -> its value). A contract declares only what differs: fields it converts
itself (`special`), the value that stands for an unset or zero field (`fallbacks`), its
own name for a field where it differs (`names`), and, for a request that spreads its
sampling over several sub-messages (vLLM's native contract), which ones (`parts`).
`covered` is what the table reads, so a test can require every proto field to be read
or refused: a field added to either proto cannot be silently ignored.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass

from ..engine import SamplingOptions

_REPEATED, _MAP, _PRESENCE, _PLAIN = range(4)
_OPTIONS = tuple(f.name for f in dataclasses.fields(SamplingOptions))


def _kind(field: FieldDescriptor) -> int:
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        return _MAP
    if field.is_repeated:
        return _REPEATED
    return _PRESENCE if field.has_presence else _PLAIN


def _qualified(part: str, name: str) -> str:
    return f"{part}.{name}" if part else name


class SamplingTable:
    """How one contract's sampling message becomes `SamplingOptions`."""

    def __init__(
        self,
        descriptor: Descriptor,
        *,
        special: Mapping[str, Callable[[Any], Any]] | None = None,
        fallbacks: Mapping[str, Any] | None = None,
        names: Mapping[str, str] | None = None,
        parts: Iterable[str] = (),
    ) -> None:
        """`special`, `fallbacks` and `names` are keyed by SamplingOptions field; `names`
        gives the proto's name for a field where it is not the same; `parts` names
        sub-messages of `descriptor` whose fields are read as its own ("" is the message)."""
        self._special = dict(special or {})
        self._fallbacks = dict(fallbacks or {})
        names = dict(names or {})
        unknown = (self._special.keys() | self._fallbacks.keys() | names.keys()) - set(_OPTIONS)
        if unknown:
            raise ValueError(f"fields SamplingOptions lacks: {sorted(unknown)}")
        messages = {"": descriptor}
        messages.update({p: descriptor.fields_by_name[p].message_type for p in parts})
        # (SamplingOptions field, sub-message ("" the message itself), proto field, kind)
        fields: list[tuple[str, str, str, int]] = []
        for option in _OPTIONS:
            proto_name = names.get(option, option)
            found = [(p, m.fields_by_name[proto_name]) for p, m in messages.items()
                     if proto_name in m.fields_by_name]  # fmt: skip
            if len(found) > 1:
                raise ValueError(f"{proto_name} is in more than one part: {found}")
            if option in self._special:
                continue
            if found:
                (part, field), = found  # fmt: skip
                fields.append((option, part, proto_name, _kind(field)))
            elif option in names:
                raise ValueError(f"names {option} as {proto_name}, which no part has")
        self._fields = tuple(fields)
        # `read` converts only the fields a message sets (ListFields: one C call a message,
        # not a getattr and HasField per field): each field by its descriptor, and every
        # other option takes the value an unset field converts to, worked out here once.
        self._parts = tuple(p for p in messages if p)
        self._by_field: dict[FieldDescriptor, tuple[str, int]] = {}
        self._unset: dict[str, Any] = {}
        empty = GetMessageClass(descriptor)()
        for option, part, proto_name, kind in fields:
            self._by_field[messages[part].fields_by_name[proto_name]] = (option, kind)
            unset_message = getattr(empty, part) if part else empty
            self._unset[option] = self._value(
                option, kind, getattr(unset_message, proto_name), present=False
            )
        # Proto fields this table reads, itself or through a same-named special converter.
        self.covered = frozenset(_qualified(part, name) for _, part, name, _ in fields) | {
            _qualified(p, name)
            for p, m in messages.items()
            for name in self._special.keys() & m.fields_by_name.keys()
        }

    def _value(self, name: str, kind: int, value: Any, *, present: bool) -> Any:
        """One field's option value: `value` as the message holds it; `present`: whether
        the message sets it (a field with presence that is unset reads as None)."""
        if kind == _REPEATED:
            value = tuple(value)
        elif kind == _MAP:
            value = dict(value) or None
        elif kind == _PRESENCE and not present:
            value = None
        if name in self._fallbacks and (value is None or (kind == _PLAIN and not value)):
            value = self._fallbacks[name]
        return value

    def read(self, params: Message) -> SamplingOptions:
        values = dict(self._unset)
        by_field = self._by_field
        for message in (params, *(getattr(params, part) for part in self._parts)):
            for field, value in message.ListFields():
                known = by_field.get(field)
                if known is not None:
                    name, kind = known
                    values[name] = self._value(name, kind, value, present=True)
        for name, convert in self._special.items():
            values[name] = convert(params)
        return SamplingOptions(**values)
