"""Verifying taskgate's webhooks on the receiving side, per the Standard Webhooks specification.

The signing rules live in one place, taskgate_api.webhook_signing, shared with the notifier that signs them: the SDK's
`verify_webhook` is its `verify`. It checks webhook-id/-timestamp/-signature against the raw body and returns the
parsed JSON payload; any of several secrets may match (during a rotation the old and the new one are both valid), and
the timestamp must be within `tolerance` seconds of `now` (default: the local clock), which bounds replays. Otherwise
it raises WebhookVerificationError.
"""

from __future__ import annotations

from taskgate_api.webhook_signing import DEFAULT_TOLERANCE_SECONDS, WebhookVerificationError, sign
from taskgate_api.webhook_signing import verify as verify_webhook

__all__ = ["DEFAULT_TOLERANCE_SECONDS", "WebhookVerificationError", "sign", "verify_webhook"]
