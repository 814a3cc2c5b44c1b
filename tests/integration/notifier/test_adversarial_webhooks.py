"""Hostile webhook receivers: trickling, huge, malformed, hung-up and redirect-looping answers never wedge the
sender."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack

import pytest

from services.notifier.service import NotifierHandle
from services.notifier.service import start as start_notifier
from taskgate import auth, store
from taskgate.config import Settings
from taskgate.runtime import Backends
from tests.support.factories import Claim, Step, insert_task, moved
from tests.support.harness import wait_for
from tests.support.webhooks import Received, Reply, WebhookReceiver

TENANT = "tenant-a"
TIMEOUT = 2.0  # short, so the suite is quick; long enough that a loaded machine does not cut an honest answer
SCHEDULE = [0.0, 0.2]
SHA = "cd" * 32

# Each receiver answers every request the same hostile way.
HOSTILE: dict[str, Reply] = {
    "hangs": Reply(status=None),
    "trickles the body": Reply(status=200, body=b"x" * 200, trickle=0.05),
    "trickles an error": Reply(status=500, body=b"x" * 200, trickle=0.05),
    "huge 200 body": Reply(status=200, body_bytes=64 * 1024 * 1024),
    "huge 500 body": Reply(status=500, body_bytes=64 * 1024 * 1024),
    "garbage instead of HTTP": Reply(raw=b"\x00\xff garbage \r\n\r\n" * 100),
    "hangs up at once": Reply(raw=b""),
    "huge header": Reply(status=200, headers={"x-big": "h" * 200_000}),
    "1xx forever": Reply(raw=b"HTTP/1.1 100 Continue\r\n\r\n" * 2000),
}
FAILING = {
    "hangs",
    "trickles the body",
    "trickles an error",
    "huge 500 body",
    "garbage instead of HTTP",
    "hangs up at once",
    "1xx forever",
    "huge header",
}


@pytest.fixture
def hook_settings(settings: Settings) -> Settings:
    return settings.model_copy(
        update={
            "webhook_schedule_seconds": SCHEDULE,
            "webhook_timeout_seconds": TIMEOUT,
            "webhook_scan_interval_seconds": 0.2,
            "relay_scan_interval_seconds": 0.2,
            "webhook_jitter": 0.0,
            "webhook_concurrency": 2,  # fewer slots than hostile receivers: a wedged slot would show
        }
    )


@pytest.fixture
async def notifier(hook_settings: Settings, backends: Backends) -> AsyncIterator[NotifierHandle]:
    await auth.create_key(backends.pool, hook_settings.api_key_pepper, TENANT)
    handle = await start_notifier(hook_settings, backends)
    try:
        yield handle
    finally:
        await handle.stop()


def always(reply: Reply) -> Callable[[Received], Reply]:
    return lambda _request: reply


async def succeed_with_callback(backends: Backends, url: str) -> int:
    task = await insert_task(backends.pool, user_id=TENANT, model_id="sleepy", callback_url=url)
    result = store.ResultRef(
        uri="nats-os://taskgate-results/x.json", content_type="application/json", size=10, sha256=SHA
    )
    changes: list[Step] = [store.Queue(), Claim(worker_id="w1", lease_seconds=30.0), store.Succeed(result)]
    for change in changes:
        assert (await moved(backends.pool, task.id, change)).applied
    return task.id


async def deliveries_ended(backends: Backends, task_ids: list[int]) -> bool:
    pending = await backends.pool.fetchval(
        "SELECT count(*) FROM callback_delivery WHERE task_id = ANY($1::bigint[]) AND status = 'PENDING'", task_ids
    )
    made = await backends.pool.fetchval(
        "SELECT count(*) FROM callback_delivery WHERE task_id = ANY($1::bigint[])", task_ids
    )
    return bool(made == len(task_ids) and pending == 0)


async def test_hostile_receivers_fail_on_schedule_and_a_good_one_still_gets_its_webhook(
    backends: Backends, notifier: NotifierHandle
) -> None:
    async with AsyncExitStack() as stack:
        receivers: dict[str, WebhookReceiver] = {}
        for name, reply in HOSTILE.items():
            receivers[name] = await stack.enter_async_context(WebhookReceiver(always(reply)))
        good = await stack.enter_async_context(WebhookReceiver())
        tasks = {name: await succeed_with_callback(backends, r.url()) for name, r in receivers.items()}
        started = time.monotonic()
        tasks["good"] = await succeed_with_callback(backends, good.url())
        budget = len(HOSTILE) * len(SCHEDULE) * (TIMEOUT + 0.5) + 10
        await wait_for(lambda: deliveries_ended(backends, list(tasks.values())), budget)
        elapsed = time.monotonic() - started

        rows = {
            r["task_id"]: r
            for r in await backends.pool.fetch(
                "SELECT task_id, status, attempts, webhook_id FROM callback_delivery WHERE task_id = ANY($1::bigint[])",
                list(tasks.values()),
            )
        }
        attempts = await backends.pool.fetch(
            "SELECT d.task_id, a.attempt, a.webhook_id, a.latency_ms, a.status_code, a.error FROM callback_attempt a "
            "JOIN callback_delivery d ON d.id = a.delivery_id WHERE d.task_id = ANY($1::bigint[]) ORDER BY a.attempt",
            list(tasks.values()),
        )
    assert len(good.requests) == 1 and rows[tasks["good"]]["status"] == "DELIVERED"
    for name, task_id in tasks.items():
        row = rows[task_id]
        logged = [a for a in attempts if a["task_id"] == task_id]
        expected = "FAILED" if name in FAILING else "DELIVERED"
        assert row["status"] == expected, (name, row["status"], [a["error"] for a in logged])
        # Every attempt is logged, numbered 1..N, under the delivery's one webhook-id; each was cut at the timeout.
        assert [a["attempt"] for a in logged] == list(range(1, row["attempts"] + 1)), name
        assert {a["webhook_id"] for a in logged} == {row["webhook_id"]}, name
        assert row["attempts"] == (len(SCHEDULE) if expected == "FAILED" else 1), name
        # cut at the timeout: the trickles would take 10 s, the hang forever
        assert all(a["latency_ms"] <= (TIMEOUT + 3) * 1000 for a in logged), (name, [a["latency_ms"] for a in logged])
    assert elapsed < budget


async def test_redirects_are_not_followed_even_in_a_loop(backends: Backends, notifier: NotifierHandle) -> None:
    async with WebhookReceiver() as target, WebhookReceiver() as looping:
        looping.reply = lambda r: Reply(status=307, headers={"location": looping.url(r.path)})
        async with WebhookReceiver(always(Reply(status=302, headers={"location": target.url()}))) as redirecting:
            ids = [
                await succeed_with_callback(backends, looping.url()),
                await succeed_with_callback(backends, redirecting.url()),
            ]
            await wait_for(lambda: deliveries_ended(backends, ids), 30)
            logged = await backends.pool.fetch(
                "SELECT d.task_id, a.attempt, a.status_code, a.error FROM callback_attempt a "
                "JOIN callback_delivery d ON d.id = a.delivery_id WHERE d.task_id = ANY($1::bigint[]) ORDER BY a.id",
                ids,
            )
            assert target.requests == []
            assert len(looping.requests) == len(SCHEDULE) and len(redirecting.requests) == len(SCHEDULE), [
                dict(r) for r in logged
            ]
            statuses = await backends.pool.fetch(
                "SELECT status, last_status_code FROM callback_delivery WHERE task_id = ANY($1::bigint[])", ids
            )
            assert sorted((s["status"], s["last_status_code"]) for s in statuses) == [("FAILED", 302), ("FAILED", 307)]
