"""The notifier's pure rules: signatures during a secret rotation, which moves become webhooks, a wait that honours a
swallowed cancellation."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from services.notifier import outbox
from taskgate import auth
from taskgate.states import Status
from taskgate.waiting import woken
from taskgate_api import webhook_signing


def test_signature_verifies_with_either_secret_during_rotation() -> None:
    old, new = auth.new_webhook_secret(), auth.new_webhook_secret()
    body = b'{"a":1}'
    now = int(time.time())
    headers = webhook_signing.headers([new, old], "msg_1_4", now, body)
    assert len(headers["webhook-signature"].split()) == 2
    assert webhook_signing.verify(headers, body, old) == {"a": 1}
    assert webhook_signing.verify(headers, body, [new]) == {"a": 1}
    with pytest.raises(webhook_signing.WebhookVerificationError):
        webhook_signing.verify(headers, b'{"a":2}', [old, new])
    with pytest.raises(webhook_signing.WebhookVerificationError):
        webhook_signing.verify(headers, body, auth.new_webhook_secret())
    with pytest.raises(webhook_signing.WebhookVerificationError, match="tolerance"):
        webhook_signing.verify(headers, body, old, now=now + 301)
    assert webhook_signing.verify(headers, body, old, now=now - 299) == {"a": 1}


def test_which_events_become_webhooks() -> None:
    for status in (Status.SUCCEEDED, Status.FAILED, Status.TIMEOUT):
        assert outbox.event_type(status, []) == f"task.{status.value.lower()}"
    assert outbox.event_type(Status.CANCELED, []) is None
    assert outbox.event_type(Status.CANCELED, ["canceled"]) == "task.canceled"
    assert outbox.event_type(Status.CANCELED, ["TASK_STATUS_CANCELED"]) == "task.canceled"
    assert outbox.event_type(Status.PROCESSING, []) is None
    assert outbox.event_type(Status.PROCESSING, ["PROGRESS"]) == "task.progress"
    assert outbox.event_type(Status.QUEUED, ["PROGRESS", "CANCELED"]) is None
    # output webhooks: only when asked for, and no outbox delivery of their own
    assert outbox.wants_output(["OUTPUT"]) and outbox.wants_output(["task.output"])
    assert not outbox.wants_output([]) and not outbox.wants_output(None) and not outbox.wants_output(["PROGRESS"])
    assert outbox.event_type(Status.PROCESSING, ["OUTPUT"]) is None


async def test_a_wait_honours_a_cancellation_that_was_swallowed_before_it() -> None:
    passes = 0
    stop = False
    inside = asyncio.Event()

    async def background_loop() -> None:
        nonlocal passes
        while not stop:
            passes += 1
            inside.set()  # no await between this and the call below: the loop is in it when the test wakes
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(30)  # a library call that catches the cancellation and carries on
            await woken(asyncio.Event(), 0.01)

    loop = asyncio.create_task(background_loop())
    await inside.wait()
    loop.cancel()
    done, _ = await asyncio.wait({loop}, timeout=5)
    stop = True
    assert loop in done and loop.cancelled() and passes == 1
