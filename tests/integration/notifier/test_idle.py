"""An idle notifier does its scans once a period and nothing in between (it woke its loop about 800 times a second:
the webhook sender read "no pending delivery" as "one due now" and scanned again after 5 ms, for ever)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from taskgate.config import Settings
from taskgate.runtime import Backends
from taskgate.store import webhooks as webhook_store

SCAN = 0.5  # the webhook sender's safety-net period here
WINDOW = 2.0  # seconds counted


async def test_no_pending_delivery_is_none_due(backends: Backends) -> None:
    assert await backends.pool.fetchval("SELECT count(*) FROM callback_delivery") == 0
    assert await webhook_store.seconds_to_next_due(backends.pool) is None


async def test_an_idle_webhook_sender_scans_once_a_period(
    backends: Backends, settings: Settings, notifier_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    claims: list[float] = []
    original = webhook_store.claim_due

    async def counted(*args: Any, **kwargs: Any) -> Any:
        claims.append(asyncio.get_running_loop().time())
        return await original(*args, **kwargs)

    monkeypatch.setattr(webhook_store, "claim_due", counted)
    await notifier_factory(settings.model_copy(update={"webhook_scan_interval_seconds": SCAN}))
    claims.clear()
    await asyncio.sleep(WINDOW)  # the window measured, nothing awaited: an idle sender must stay idle through it
    passes = len(claims) / 2  # a pass claims for each of its two lanes (results, progress)
    assert passes <= WINDOW / SCAN + 1, f"{passes:.0f} passes in {WINDOW} s with a {SCAN} s scan period"
