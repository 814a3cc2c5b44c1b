"""Opaque page tokens for every keyset listing: a cursor over (timestamp, id), bound to the filter that made it."""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
MAX_ID = 2**63 - 1  # ids are PostgreSQL bigints


@dataclass(frozen=True, slots=True)
class Cursor:
    """The last row of a page: the next page starts strictly after it."""

    at: datetime  # the listing's ordering timestamp (created_at, updated_at, dead_at, ...)
    task_id: int


class BadToken(ValueError):
    """A page token that is malformed or was made for another filter."""


def filter_key(*parts: object) -> str:
    """A short fingerprint of a listing's filter, so a token cannot be replayed with another one."""
    return hashlib.sha256(json.dumps([str(p) for p in parts]).encode()).hexdigest()[:16]


def encode(cursor: Cursor, filter_fp: str) -> str:
    micros = (cursor.at - _EPOCH) // timedelta(microseconds=1)
    raw = json.dumps({"c": micros, "i": str(cursor.task_id), "f": filter_fp}, separators=(",", ":"))
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def decode(token: str, filter_fp: str) -> Cursor:
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
        data = json.loads(raw)
        cursor = Cursor(_EPOCH + timedelta(microseconds=int(data["c"])), int(data["i"]))
        same_filter = data["f"] == filter_fp
    except (binascii.Error, ValueError, TypeError, KeyError, OverflowError) as exc:
        raise BadToken("malformed page token") from exc
    if not 0 <= cursor.task_id <= MAX_ID:
        raise BadToken("malformed page token")
    if not same_filter:
        raise BadToken("page token belongs to another filter")
    return cursor
