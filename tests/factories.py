"""Rows for tests, inserted by the store function that also inserts the submit service's tasks."""

from __future__ import annotations

import hashlib
import json
from typing import Any

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
