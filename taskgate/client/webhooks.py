"""Verifying taskgate's webhooks on the receiving side, per the Standard Webhooks specification."""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import time
from collections.abc import Iterable, Mapping
from typing import Any

SECRET_PREFIX = "whsec_"
DEFAULT_TOLERANCE_SECONDS = 300


class WebhookVerificationError(Exception):
    """The request is not a valid, fresh webhook signed with one of the given secrets."""


def _key(secret: str) -> bytes:
    body = secret.removeprefix(SECRET_PREFIX)
    try:
        return base64.b64decode(body, validate=True)
    except (binascii.Error, ValueError):
        raise WebhookVerificationError("secret is not base64 (expected 'whsec_<base64>')") from None


def sign(secret: str, msg_id: str, timestamp: int, body: bytes) -> str:
    """The `webhook-signature` value ("v1,<base64 HMAC-SHA256>") for one message."""
    content = f"{msg_id}.{timestamp}.".encode() + body
    return "v1," + base64.b64encode(hmac.new(_key(secret), content, hashlib.sha256).digest()).decode()


def _header(headers: Mapping[str, str], name: str) -> str:
    for key, value in headers.items():
        if key.lower() == name:
            return value
    raise WebhookVerificationError(f"missing header {name}")


def verify_webhook(
    headers: Mapping[str, str],
    body: bytes | str,
    secret: str | Iterable[str],
    tolerance: float = DEFAULT_TOLERANCE_SECONDS,
    *,
    now: float | None = None,
) -> Any:
    """Checks webhook-id/-timestamp/-signature against the raw body and returns the parsed JSON payload.

    `secret` may be several secrets (during a rotation both the old and the new one are valid). The timestamp must
    be within `tolerance` seconds of `now` (default: the local clock), which bounds replays.
    """
    raw = body.encode() if isinstance(body, str) else bytes(body)
    msg_id = _header(headers, "webhook-id")
    stamp = _header(headers, "webhook-timestamp")
    signatures = _header(headers, "webhook-signature")
    try:
        timestamp = int(stamp)
    except ValueError:
        raise WebhookVerificationError("webhook-timestamp is not an integer") from None
    current = time.time() if now is None else now
    if abs(current - timestamp) > tolerance:
        raise WebhookVerificationError("webhook-timestamp is outside the tolerance (replayed or clock skew)")
    secrets = [secret] if isinstance(secret, str) else list(secret)
    if not secrets:
        raise WebhookVerificationError("no secret given")
    expected = [sign(s, msg_id, timestamp, raw).split(",", 1)[1].encode() for s in secrets]
    for candidate in signatures.split():
        version, _, value = candidate.partition(",")
        if version != "v1":
            continue
        if any(hmac.compare_digest(value.encode(), e) for e in expected):
            try:
                return json.loads(raw)
            except ValueError:
                raise WebhookVerificationError("the body is not JSON") from None
    raise WebhookVerificationError("no valid signature")
