"""Rows for tests, inserted by the store function that also inserts the submit service's tasks."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from hypothesis import strategies as st

from taskgate import auth, ids
from taskgate.model import TaskRow
from taskgate.runtime import Backends
from taskgate.store import Conn, submissions

Metadata = tuple[tuple[str, str], ...]

# What PostgreSQL cannot store: U+0000 and lone surrogates (a client in another language can send the latter as bytes).
UNSTORABLE_CHAR: st.SearchStrategy[str] = st.one_of(
    st.sampled_from(["\x00", "\ud800", "\udbff", "\udc00", "\udfff"]), st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
)
# Any character, surrogates included (hypothesis leaves them out by default).
ANY_CHAR: st.SearchStrategy[str] = st.characters(exclude_categories=[])


def unstorable_text(max_size: int = 20) -> st.SearchStrategy[str]:
    """Text holding at least one U+0000 or lone surrogate somewhere among any other characters."""
    part = st.text(ANY_CHAR, max_size=max_size)
    return st.tuples(part, UNSTORABLE_CHAR, part).map("".join)


def any_text(max_size: int = 60, *, surrogates: bool = True) -> st.SearchStrategy[str]:
    """Any text, U+0000 included, and lone surrogates unless the caller must build a protobuf message from it."""
    if surrogates:
        return st.one_of(st.text(ANY_CHAR, max_size=max_size), unstorable_text(max_size // 2))
    nul = st.tuples(st.text(max_size=max_size // 2), st.text(max_size=max_size // 2)).map("\x00".join)
    return st.one_of(st.text(max_size=max_size), nul)


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | (0x80 if value else 0))
        if not value:
            return bytes(out)


def wire_field(number: int, data: bytes) -> bytes:
    """One length-delimited protobuf field (a string, a message or a map entry) holding `data`."""
    return _varint(number << 3 | 2) + _varint(len(data)) + data


def wire_text(value: str) -> bytes:
    """`value` as UTF-8 with lone surrogates kept as their three bytes: what the protobuf library refuses to send."""
    return value.encode("utf-8", "surrogatepass")


async def insert_task(
    db: Conn,
    *,
    user_id: str = "tenant-a",
    model_id: str = "wan-tiny",
    prompt: str = "a red fox in the snow",
    priority: int = 5,
    callback_url: str | None = None,
    params: dict[str, Any] | None = None,
    max_retries: int = 3,
) -> TaskRow:
    payload = params or {"num_frames": 9, "width": 32, "height": 32, "num_inference_steps": 2,
                         "guidance_scale": 5.0, "fps": 8, "seed": 1, "negative_prompt": ""}
    task_id = ids.new_id()
    digest = hashlib.sha256(json.dumps([user_id, model_id, prompt, payload], sort_keys=True).encode()).hexdigest()
    task = await submissions.create(
        db,
        submissions.NewTask(
            id=task_id, user_id=user_id, idempotency_key=f"k-{task_id}", key_derived=False, request_hash=digest,
            task_type="text-to-video", model_id=model_id, prompt=prompt, payload=payload, metadata={}, priority=priority,
            max_retries=max_retries, callback_url=callback_url, callback_events=[],
        ),
    )
    assert task is not None
    return task


async def key_for(backends: Backends, tenant: str = "tenant-a", **limits: Any) -> Metadata:
    """Call metadata carrying a fresh API key of `tenant` (limits as taskgate.auth.create_key takes them)."""
    key, _ = await auth.create_key(backends.pool, backends.settings.api_key_pepper, tenant, **limits)
    return (("authorization", f"Bearer {key}"),)


# ---------------------------------------------------------------- any protobuf message, from its descriptor


_INT_RANGES = {
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1), FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SFIXED32: (-(2**31), 2**31 - 1), FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1), FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1), FieldDescriptor.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1), FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
}
# strings that reach deeper than random text: ids at and past the int64 edge, cursors, times, statuses
_PROBES = ["", "0", "1", "-1", "9223372036854775807", "9223372036854775808", "99999999999999999999", "1e3", " 1", "wan-tiny",
           "sleepy", "text-to-video", "image-to-video", "SUCCEEDED", "https://example.com/x.png", "eyJjIjowfQ"]


def _int_edges(low: int, high: int) -> st.SearchStrategy[int]:
    return st.one_of(st.integers(low, high), st.sampled_from(sorted({low, high, 0, 1, -1 if low < 0 else 0, low + 1, high - 1})))


def _value(field: Any, depth: int) -> st.SearchStrategy[Any]:
    """Any value of one field (a FieldDescriptor, from the pure-Python or the upb implementation)."""
    if field.message_type is not None:
        return proto_messages(field.message_type._concrete_class, depth + 1)
    if field.enum_type is not None:
        return st.one_of(st.sampled_from([v.number for v in field.enum_type.values]), st.integers(-(2**31), 2**31 - 1))
    if field.type in _INT_RANGES:
        return _int_edges(*_INT_RANGES[field.type])
    if field.type in (FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_DOUBLE):
        return st.floats(width=32 if field.type == FieldDescriptor.TYPE_FLOAT else 64)
    if field.type == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if field.type == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=64)
    return st.one_of(st.sampled_from(_PROBES), any_text(40, surrogates=False))


def proto_messages(cls: type[Message], depth: int = 0) -> st.SearchStrategy[Message]:
    """Any message of `cls`: each field unset or set to any value its type can carry (ints to their edges, enums past
    their names, timestamps in any year, strings that look like ids and cursors), nested messages to a few levels."""
    descriptor = cls.DESCRIPTOR
    if descriptor.full_name == "google.protobuf.Timestamp":
        return st.builds(
            lambda s, n: cls(seconds=s, nanos=n), _int_edges(-(2**40), 2**40), _int_edges(-(2**31), 2**31 - 1)
        )
    if descriptor.full_name == "google.protobuf.Duration":
        return st.builds(lambda s, n: cls(seconds=s, nanos=n), _int_edges(-(2**40), 2**40), st.integers(-999_999_999, 999_999_999))
    fields: dict[str, st.SearchStrategy[Any]] = {}
    for field in descriptor.fields:
        if depth >= 3 and field.message_type is not None:
            continue
        value = _value(field, depth)
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            key, item = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
            fields[field.name] = st.dictionaries(_value(key, depth), _value(item, depth), max_size=3)
        elif field.is_repeated:
            fields[field.name] = st.lists(value, max_size=3)
        else:
            fields[field.name] = value

    @st.composite
    def build(draw: st.DrawFn) -> Message:
        message = cls()
        for name in draw(st.lists(st.sampled_from(sorted(fields)), unique=True)) if fields else []:
            field = descriptor.fields_by_name[name]
            value = draw(fields[name])
            if field.message_type is not None and field.message_type.GetOptions().map_entry:
                target = getattr(message, name)
                for k, v in value.items():
                    if isinstance(v, Message):
                        target[k].CopyFrom(v)
                    else:
                        target[k] = v
            elif field.is_repeated:
                getattr(message, name).extend(value)
            elif field.message_type is not None:
                getattr(message, name).CopyFrom(value)
            else:
                setattr(message, name, value)
        return message

    return build()
