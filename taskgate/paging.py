"""Opaque page tokens for every keyset listing: a cursor over (timestamp, id), bound to the filter that made it and
signed (HMAC-SHA256 with a key derived from the service's secret), so a client can neither forge a position nor
replay a token with another filter."""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
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


class Pager:
    """Makes and reads the page tokens of one service, signed with a key derived from `secret`."""

    def __init__(self, secret: str) -> None:
        self._key = hmac.new(secret.encode(), b"taskgate page tokens v1", hashlib.sha256).digest()

    def _signature(self, micros: int, task_id: str, filter_fp: str) -> str:
        mac = hmac.new(self._key, f"{micros}|{task_id}|{filter_fp}".encode(), hashlib.sha256).digest()[:16]
        return base64.urlsafe_b64encode(mac).decode().rstrip("=")

    def encode(self, cursor: Cursor, filter_fp: str) -> str:
        micros = (cursor.at - _EPOCH) // timedelta(microseconds=1)
        task_id = str(cursor.task_id)
        raw = json.dumps(
            {"c": micros, "i": task_id, "f": filter_fp, "s": self._signature(micros, task_id, filter_fp)},
            separators=(",", ":"),
        )
        return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")

    def decode(self, token: str, filter_fp: str) -> Cursor:
        """The cursor of a token this service made for this filter; BadToken otherwise."""
        try:
            raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
            data = json.loads(raw)
            micros, task_id, made_for, signature = int(data["c"]), str(data["i"]), str(data["f"]), str(data["s"])
        except (binascii.Error, ValueError, TypeError, KeyError, OverflowError) as exc:
            raise BadToken("malformed page token") from exc
        if not hmac.compare_digest(signature, self._signature(micros, task_id, made_for)):
            raise BadToken("page token was not made by this service")
        if made_for != filter_fp:
            raise BadToken("page token belongs to another filter")
        try:
            cursor = Cursor(_EPOCH + timedelta(microseconds=micros), int(task_id))
        except (ValueError, OverflowError) as exc:
            raise BadToken("malformed page token") from exc
        if not 0 <= cursor.task_id <= MAX_ID:
            raise BadToken("malformed page token")
        return cursor
