"""Inputs a tenant uploaded: images of image-to-video requests and text attachments of chat tasks; which tenant holds
which stored input (the object is in the result store)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from taskgate import sql
from taskgate.store.pool import Conn


@dataclass(frozen=True, slots=True)
class StoredInput:
    """A tenant's input image as recorded: its canonical PNG's sha256, where the object is, and its size."""

    sha256: str
    uri: str
    width: int
    height: int
    size_bytes: int

    def payload(self) -> dict[str, Any]:
        """What a task's request payload holds of it (the worker reads `uri`; `sha256` enters the request hash)."""
        return {
            "sha256": self.sha256,
            "width": self.width,
            "height": self.height,
            "size_bytes": self.size_bytes,
            "uri": self.uri,
        }


def _stored(rec: Any) -> StoredInput:
    return StoredInput(rec["sha256"], rec["uri"], rec["width"], rec["height"], rec["size_bytes"])


async def keep(db: Conn, tenant: str, image: StoredInput, *, within: float) -> StoredInput:
    """Records the tenant's input (or marks it used again); call before writing the object (the query says why)."""
    rec = await db.fetchrow(
        *sql.bind(
            "submit_keep_input",
            user_id=tenant,
            sha256=image.sha256,
            uri=image.uri,
            width=image.width,
            height=image.height,
            size_bytes=image.size_bytes,
        ),
        timeout=within,
    )
    return _stored(rec)


async def use(db: Conn, tenant: str, sha256: str, *, within: float) -> StoredInput | None:
    """The tenant's stored input of this sha256, marked used now; None when it has none."""
    rec = await db.fetchrow(sql.query("submit_use_input"), tenant, sha256, timeout=within)
    return None if rec is None else _stored(rec)


@dataclass(frozen=True, slots=True)
class StoredText:
    """A tenant's text attachment as recorded: the sha256 of its UTF-8 bytes, where the object is, its size in bytes
    and its length in characters."""

    sha256: str
    uri: str
    size_bytes: int
    chars: int


def _text(rec: Any) -> StoredText:
    return StoredText(rec["sha256"], rec["uri"], rec["size_bytes"], rec["chars"])


async def keep_text(db: Conn, tenant: str, text: StoredText, *, within: float) -> StoredText | None:
    """Records the tenant's text attachment (or marks it used again); call before writing the object. None when the
    tenant holds an image of that sha256 (no text and image share one)."""
    rec = await db.fetchrow(
        *sql.bind(
            "submit_keep_text",
            user_id=tenant,
            sha256=text.sha256,
            uri=text.uri,
            size_bytes=text.size_bytes,
            chars=text.chars,
        ),
        timeout=within,
    )
    return None if rec is None else _text(rec)


async def use_text(db: Conn, tenant: str, sha256: str, *, within: float) -> StoredText | None:
    """The tenant's stored text attachment of this sha256, marked used now; None when it has none."""
    rec = await db.fetchrow(sql.query("submit_use_text"), tenant, sha256, timeout=within)
    return None if rec is None else _text(rec)
