"""Webhooks fair per destination: one tenant's hung or failing receiver cannot hold another tenant's webhooks back,
a failing destination trips its breaker, and progress webhooks go in their own lane, newest only, never retried."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import asyncpg

from services.notifier.service import start as start_notifier
from taskgate import auth, ids, store
from taskgate.config import Settings
from taskgate.model import TaskRow
from taskgate.runtime import Backends
from taskgate.store import submissions
from tests.support.factories import RESULT, claimed
from tests.support.harness import wait_for
from tests.support.webhooks import Received, Reply, WebhookReceiver


def quick(settings: Settings, **update: Any) -> Settings:
    """Short scan periods; whatever the test sets."""
    return settings.model_copy(
        update={
            "relay_scan_interval_seconds": 0.1,
            "webhook_scan_interval_seconds": 0.1,
            "webhook_jitter": 0.0,
            **update,
        }
    )


async def task_for(pool: asyncpg.Pool, tenant: str, url: str, events: Sequence[str] = ()) -> TaskRow:
    task_id = ids.new_id()
    task = await submissions.create(
        pool,
        submissions.NewTask(
            id=task_id, user_id=tenant, idempotency_key=f"k-{task_id}", key_derived=False, request_hash=f"h-{task_id}",
            task_type="text-to-video", model_id="sleepy", prompt="p", payload={"seed": 1}, metadata={}, priority=5,
            max_retries=0, callback_url=url, callback_events=list(events),
        ),
    )
    assert task is not None
    return task


async def started(pool: asyncpg.Pool, task_id: int) -> None:
    assert (await store.queue(pool, task_id, actor="test")).applied
    await claimed(pool, task_id, worker_id="w1", lease_seconds=60.0)


async def succeeded(pool: asyncpg.Pool, task_id: int) -> None:
    await started(pool, task_id)
    assert (await store.apply(pool, task_id, store.Succeed(RESULT), actor="test")).applied


def replies(*first: Reply) -> Callable[[Received], Reply]:
    """Answers the first requests with `first`, in order, and every later one with 200."""
    seen = [0]

    def reply(_request: Received) -> Reply:
        seen[0] += 1
        return first[seen[0] - 1] if seen[0] <= len(first) else Reply()

    return reply


async def test_a_hung_receiver_holds_only_its_destinations_cap_and_another_tenant_is_delivered_at_once(
    backends: Backends, settings: Settings
) -> None:
    pool = backends.pool
    for tenant in ("stuck", "fine"):
        await auth.create_key(pool, settings.api_key_pepper, tenant)
    own = quick(settings, webhook_concurrency=4, webhook_concurrency_per_destination=2, webhook_timeout_seconds=8.0,
                webhook_schedule_seconds=[0.0, 60.0])
    async with WebhookReceiver(lambda _r: Reply(status=None)) as hung, WebhookReceiver() as healthy:
        handle = await start_notifier(own, backends)
        try:
            for _ in range(6):
                await succeeded(pool, (await task_for(pool, "stuck", hung.url())).id)
            await wait_for(lambda: len(hung.requests) == 2)  # the destination's cap, though 4 slots are free
            began = time.monotonic()
            await succeeded(pool, (await task_for(pool, "fine", healthy.url())).id)
            await wait_for(lambda: len(healthy.requests) == 1, within=6.0)
            # well inside the 8 s the hung attempts hold their slots: the healthy tenant never waited for them
            assert time.monotonic() - began < 6.0
            assert len(hung.requests) == 2
        finally:
            await handle.stop()


async def test_a_failing_destination_trips_its_breaker_then_lets_one_attempt_through_then_closes(
    backends: Backends, settings: Settings
) -> None:
    pool = backends.pool
    await auth.create_key(pool, settings.api_key_pepper, "tenant-a")
    own = quick(
        settings,
        webhook_breaker_failures=3,
        webhook_breaker_seconds=1.5,
        webhook_concurrency_per_destination=4,
        webhook_schedule_seconds=[0.0, 0.05, 0.05, 0.05, 0.05, 0.05],
    )
    trial = Reply(trickle=0.2)  # a slow 200: its second body byte 0.2 s after the first
    async with WebhookReceiver(replies(Reply(500), Reply(500), Reply(500), trial)) as rx:
        handle = await start_notifier(own, backends)
        try:
            first = await task_for(pool, "tenant-a", rx.url())
            await succeeded(pool, first.id)
            await wait_for(lambda: len(rx.requests) == 3)

            async def breaker_open() -> bool:  # the third 500 is recorded after the receiver saw the request
                row = await pool.fetchrow("SELECT failures, open_until FROM webhook_destination")
                return row is not None and row["failures"] == 3 and row["open_until"] is not None

            await wait_for(breaker_open, within=5.0)
            for _ in range(3):  # while the breaker is open, new webhooks wait for it too
                await succeeded(pool, (await task_for(pool, "tenant-a", rx.url())).id)
            await wait_for(lambda: len(rx.requests) == 7, within=10.0)  # 3 failures, the trial, the other 3
        finally:
            await handle.stop()
    at = [r.at for r in rx.requests]
    assert at[3] - at[2] >= 1.4  # the breaker held the 4th attempt (its schedule said 0.05 s)
    assert at[4] - at[3] >= 0.19  # half-open: the trial alone in flight until it answered
    assert at[6] - at[4] < 0.19  # closed again: the rest went together
    assert await pool.fetchval("SELECT count(*) FROM webhook_destination") == 0
    statuses = await pool.fetch("SELECT status FROM callback_delivery")
    assert {r["status"] for r in statuses} == {"DELIVERED"} and len(statuses) == 4


async def test_progress_webhooks_send_only_the_newest_and_are_not_retried(
    backends: Backends, settings: Settings
) -> None:
    pool = backends.pool
    await auth.create_key(pool, settings.api_key_pepper, "tenant-a")
    own = quick(settings, webhook_concurrency_per_destination=1, webhook_timeout_seconds=1.0,
                webhook_schedule_seconds=[0.0, 0.05, 0.05])
    async with WebhookReceiver(replies(Reply(status=None))) as rx:
        handle = await start_notifier(own, backends)
        try:
            task = await task_for(pool, "tenant-a", rx.url(), events=["PROGRESS"])
            await started(pool, task.id)  # the claim's webhook (progress 0) hangs, holding the destination's one place
            await wait_for(lambda: len(rx.requests) == 1)
            for step in (10, 20, 30, 40):
                change = store.Progress(percent=step, lease_seconds=60.0)
                assert (await store.apply(pool, task.id, change, actor="test")).applied
            await wait_for(lambda: len(rx.requests) == 2, within=5.0)
        finally:
            await handle.stop()
    assert [r.json()["data"]["progress"] for r in rx.requests] == [0, 40]  # 10, 20, 30 were superseded unsent
    rows = await pool.fetch(
        "SELECT payload->'data'->>'progress' AS progress, status, attempts FROM callback_delivery ORDER BY event_id"
    )
    assert [(r["progress"], r["status"], r["attempts"]) for r in rows] == [("0", "FAILED", 1), ("40", "DELIVERED", 1)]
