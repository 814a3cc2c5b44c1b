"""Verifying taskgate's webhooks on the receiving side, per the Standard Webhooks specification.

The signing rules live in one place, taskgate.webhook_signing, shared with the notifier that signs them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from taskgate.webhook_signing import DEFAULT_TOLERANCE_SECONDS, WebhookVerificationError, sign, verify


def verify_webhook(
    headers: Mapping[str, str],
    body: bytes | str,
    secret: str | Iterable[str],
    tolerance: float = DEFAULT_TOLERANCE_SECONDS,
    *,
    now: float | None = None,
) -> Any:
    """Checks webhook-id/-timestamp/-signature against the raw body and returns the parsed JSON payload.

    `secret` may be several secrets (during a rotation the old and the new one are both valid). The timestamp must
    be within `tolerance` seconds of `now` (default: the local clock), which bounds replays. Raises
    WebhookVerificationError otherwise.
    """
    return verify(headers, body, secret, tolerance, now=now)


__all__ = ["DEFAULT_TOLERANCE_SECONDS", "WebhookVerificationError", "sign", "verify_webhook"]
