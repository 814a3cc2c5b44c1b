"""verify_webhook against Standard Webhooks vectors computed here by hand (hmac + base64), and the reference library."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import threading
import time
from datetime import UTC, datetime

import httpx
import pytest
import standardwebhooks

from taskgate_client import WebhookVerificationError, verify_webhook
from tests.support.harness import load_example

KEY = bytes(range(32))
SECRET = "whsec_" + base64.b64encode(KEY).decode()
OTHER = "whsec_" + base64.b64encode(b"\x01" * 32).decode()
MSG_ID = "msg_2KWPBgLlAfxdpx2AI54pPJ85f4W"
NOW = 1_700_000_000
BODY = json.dumps({"type": "task.succeeded", "data": {"task_id": "123", "status": "SUCCEEDED"}}).encode()


def by_hand(key: bytes, msg_id: str, timestamp: int, body: bytes) -> str:
    """The spec's signature, written out: base64(HMAC-SHA256(key, f"{id}.{timestamp}.{body}"))."""
    mac = hmac.new(key, msg_id.encode() + b"." + str(timestamp).encode() + b"." + body, hashlib.sha256)
    return "v1," + base64.b64encode(mac.digest()).decode()


def headers(signature: str, timestamp: int = NOW, msg_id: str = MSG_ID) -> dict[str, str]:
    return {"webhook-id": msg_id, "webhook-timestamp": str(timestamp), "webhook-signature": signature}


def test_valid_signature_returns_the_payload() -> None:
    payload = verify_webhook(headers(by_hand(KEY, MSG_ID, NOW, BODY)), BODY, SECRET, now=NOW)
    assert payload == json.loads(BODY)


def test_fixed_vector() -> None:
    # A constant, so a change in the byte layout (separators, encoding) cannot hide behind by_hand().
    body = b'{"test": 2432232314}'
    key = base64.b64decode("MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")
    expected = by_hand(key, "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, body)
    assert expected == "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
    signed = headers(expected, 1614265330, "msg_p5jXN8AQM9LWM0D4loKWxJek")
    assert verify_webhook(signed, body, "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", now=1614265330) == {
        "test": 2432232314
    }


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ("body", "no valid signature"),
        ("id", "no valid signature"),
        ("secret", "no valid signature"),
        ("old", "outside the tolerance"),
        ("future", "outside the tolerance"),
    ],
)
def test_tampering_is_refused(change: str, why: str) -> None:
    signature = by_hand(KEY, MSG_ID, NOW, BODY)
    body, msg_id, secret, now = BODY, MSG_ID, SECRET, NOW
    if change == "body":
        body = BODY.replace(b"SUCCEEDED", b"FAILED")
    elif change == "id":
        msg_id = "msg_other"
    elif change == "secret":
        secret = OTHER
    elif change == "old":
        now = NOW + 301
    elif change == "future":
        now = NOW - 301
    with pytest.raises(WebhookVerificationError, match=why):
        verify_webhook(headers(signature, msg_id=msg_id), body, secret, now=now)


def test_tolerance_is_inclusive_and_configurable() -> None:
    signed = headers(by_hand(KEY, MSG_ID, NOW, BODY))
    assert verify_webhook(signed, BODY, SECRET, now=NOW + 300)
    with pytest.raises(WebhookVerificationError):
        verify_webhook(signed, BODY, SECRET, tolerance=10, now=NOW + 11)


def test_rotation_any_secret_and_any_signature_may_match() -> None:
    # During a rotation the sender signs with both secrets; a receiver may know either.
    old_key = b"\x01" * 32
    both = f"{by_hand(old_key, MSG_ID, NOW, BODY)} {by_hand(KEY, MSG_ID, NOW, BODY)}"
    assert verify_webhook(headers(both), BODY, SECRET, now=NOW)
    assert verify_webhook(headers(both), BODY, OTHER, now=NOW)
    only_new = by_hand(KEY, MSG_ID, NOW, BODY)
    assert verify_webhook(headers(only_new), BODY, [OTHER, SECRET], now=NOW)


def test_header_names_are_case_insensitive_and_unknown_versions_ignored() -> None:
    good = by_hand(KEY, MSG_ID, NOW, BODY)
    mixed = {"Webhook-Id": MSG_ID, "WEBHOOK-TIMESTAMP": str(NOW), "Webhook-Signature": f"v2,{good[3:]} {good}"}
    assert verify_webhook(mixed, BODY, SECRET, now=NOW)
    with pytest.raises(WebhookVerificationError):
        verify_webhook(headers(f"v2,{good[3:]}"), BODY, SECRET, now=NOW)


@pytest.mark.parametrize("missing", ["webhook-id", "webhook-timestamp", "webhook-signature"])
def test_missing_headers_are_refused(missing: str) -> None:
    signed = headers(by_hand(KEY, MSG_ID, NOW, BODY))
    del signed[missing]
    with pytest.raises(WebhookVerificationError, match=missing):
        verify_webhook(signed, BODY, SECRET, now=NOW)


def test_malformed_inputs_are_refused() -> None:
    signed = headers(by_hand(KEY, MSG_ID, NOW, BODY))
    with pytest.raises(WebhookVerificationError):
        verify_webhook({**signed, "webhook-timestamp": "soon"}, BODY, SECRET, now=NOW)
    with pytest.raises(WebhookVerificationError):
        verify_webhook(signed, BODY, "whsec_not base64!", now=NOW)
    with pytest.raises(WebhookVerificationError):
        verify_webhook(signed, BODY, [], now=NOW)


def test_agrees_with_the_reference_library() -> None:
    reference = standardwebhooks.Webhook(SECRET)
    signature = reference.sign(MSG_ID, datetime.fromtimestamp(NOW, tz=UTC), BODY.decode())
    assert signature == by_hand(KEY, MSG_ID, NOW, BODY)
    assert verify_webhook(headers(signature), BODY, SECRET, now=NOW) == json.loads(BODY)


# -- end to end: the notifier signs, the example receiver verifies ------------------------------------------------






async def test_example_receiver_refuses_a_bad_signature() -> None:
    example = load_example()
    receiver = example.make_server("127.0.0.1", 0, [SECRET], lambda event: None)
    thread = threading.Thread(target=receiver.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{receiver.server_port}/hook"
    now = int(time.time())
    try:
        async with httpx.AsyncClient() as http:
            good = await http.post(url, content=BODY, headers=headers(by_hand(KEY, MSG_ID, now, BODY), now))
            bad = await http.post(url, content=BODY, headers=headers(by_hand(b"\x02" * 32, MSG_ID, now, BODY), now))
    finally:
        receiver.shutdown()
        receiver.server_close()
    assert (good.status_code, bad.status_code) == (204, 401)
