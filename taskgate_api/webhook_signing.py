"""Standard Webhooks signatures: the notifier signs with every valid tenant secret, receivers verify."""

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
    """The request is not a fresh webhook signed with one of the given secrets."""


def secret_key(secret: str) -> bytes:
    """The HMAC key of a 'whsec_<base64>' secret: the base64-decoded part after the prefix."""
    try:
        key = base64.b64decode(secret.removeprefix(SECRET_PREFIX), validate=True)
    except (binascii.Error, ValueError):
        raise WebhookVerificationError("secret is not base64 (expected 'whsec_<base64>')") from None
    if not key:
        raise WebhookVerificationError("secret is empty")
    return key


def sign(secret: str, msg_id: str, timestamp: int, body: bytes) -> str:
    """One signature, "v1,<base64 HMAC-SHA256 of '<id>.<timestamp>.<body>'>"."""
    content = f"{msg_id}.{int(timestamp)}.".encode() + body
    return "v1," + base64.b64encode(hmac.new(secret_key(secret), content, hashlib.sha256).digest()).decode()


def signature_header(secrets: Iterable[str], msg_id: str, timestamp: int, body: bytes) -> str:
    """The `webhook-signature` value: one signature per valid secret, space-separated (rotation)."""
    return " ".join(sign(s, msg_id, timestamp, body) for s in secrets)


def headers(secrets: Iterable[str], msg_id: str, timestamp: int, body: bytes) -> dict[str, str]:
    """The three Standard Webhooks headers of one message."""
    return {
        "webhook-id": msg_id,
        "webhook-timestamp": str(int(timestamp)),
        "webhook-signature": signature_header(secrets, msg_id, timestamp, body),
    }


def _header(found: Mapping[str, str], name: str) -> str:
    for key, value in found.items():
        if key.lower() == name:
            return value
    raise WebhookVerificationError(f"missing header {name}")


def verify(
    headers: Mapping[str, str],
    body: bytes | str,
    secrets: str | Iterable[str],
    tolerance: float = DEFAULT_TOLERANCE_SECONDS,
    *,
    now: float | None = None,
) -> Any:
    """Checks the webhook headers against the raw body; returns the parsed JSON payload or raises.

    Any of `secrets` may match (two are valid during a rotation); the timestamp must be within `tolerance` seconds
    of `now` (default: the local clock), which bounds replays.
    """
    raw = body.encode() if isinstance(body, str) else bytes(body)
    msg_id = _header(headers, "webhook-id")
    stamp = _header(headers, "webhook-timestamp")
    offered = _header(headers, "webhook-signature")
    try:
        timestamp = int(stamp)
    except ValueError:
        raise WebhookVerificationError("webhook-timestamp is not an integer") from None
    current = time.time() if now is None else now
    if abs(current - timestamp) > tolerance:
        raise WebhookVerificationError("webhook-timestamp is outside the tolerance (replayed or clock skew)")
    candidates = [secrets] if isinstance(secrets, str) else list(secrets)
    if not candidates:
        raise WebhookVerificationError("no secret given")
    expected = [sign(s, msg_id, timestamp, raw).encode() for s in candidates]
    for signature in offered.split():
        if signature.startswith("v1,") and any(hmac.compare_digest(signature.encode(), e) for e in expected):
            try:
                return json.loads(raw)
            except ValueError:
                raise WebhookVerificationError("the body is not JSON") from None
    raise WebhookVerificationError("no valid signature")
