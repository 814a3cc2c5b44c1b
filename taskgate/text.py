"""What PostgreSQL cannot store in text or jsonb (U+0000, lone surrogates), found before a statement fails on it."""

from __future__ import annotations

import re
from collections.abc import Iterable

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.empty_pb2 import Empty
from google.protobuf.message import DecodeError
from google.protobuf.unknown_fields import UnknownFieldSet

_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")


def unstorable(value: str) -> str | None:
    """Why PostgreSQL would refuse `value` (U+0000 or a lone surrogate), or None when it can store it."""
    found = _UNSTORABLE.search(value)
    if found is None:
        return None
    if found.group() == "\x00":
        return "contains U+0000, which cannot be stored"
    return f"contains a lone surrogate (U+{ord(found.group()):04X}), which cannot be stored"


def check(field: str, values: Iterable[str], bad: list[tuple[str, str]]) -> None:
    """Records one violation for `field` when any of `values` cannot be stored."""
    for value in values:
        why = unstorable(value)
        if why is not None:
            bad.append((field, why))
            return


def undecodable_fields(descriptor: Descriptor, data: bytes, prefix: str = "") -> list[str]:
    """The string fields of a serialized message whose bytes are not UTF-8 (a lone surrogate, say), by field path.

    The message is read as unknown fields of an empty one, so its strings are not decoded on the way.
    """
    try:
        fields = UnknownFieldSet(Empty.FromString(data))
    except DecodeError:
        return []
    found: list[str] = []
    for raw in (fields[i] for i in range(len(fields))):  # the stubs type it as a sequence, not an iterable
        field = descriptor.fields_by_number.get(raw.field_number)
        if field is None or not isinstance(raw.data, bytes):
            continue
        name = prefix + field.name
        if field.type == FieldDescriptor.TYPE_STRING:
            try:
                raw.data.decode()
            except UnicodeDecodeError:
                found.append(name)
        elif field.type == FieldDescriptor.TYPE_MESSAGE and field.message_type is not None:
            nested = field.message_type
            if nested.GetOptions().map_entry:  # a map's entries are named by the map, as its validation names them
                if undecodable_fields(nested, raw.data):
                    found.append(name)
            else:
                found.extend(undecodable_fields(nested, raw.data, name + "."))
    return list(dict.fromkeys(found))
