"""Metering: a real worker's attempts record their device and slot seconds on the task and per tenant, model and hour;
GetUsage reads the sums, GetTask and a finished task's webhook carry the task's own figures."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import grpc
import pytest

from services.notifier import outbox
from taskgate import auth, ids, store
from taskgate.runtime import Backends
from taskgate.states import Status
from taskgate.store import events, submissions, tenants
from taskgate.store.submissions import Candidate, NewTask
from taskgate_api.v1 import admin_pb2
from tests.support.factories import SLEEPY, all_settings, claimed, params, publish, sleepy_settings, submit, with_
from tests.support.harness import WorkerFactory as Factory
from tests.support.queries import is_status, wait_task
from tests.support.stacks import Admin

SLEEP = 0.3  # each attempt's device phase


async def test_a_retried_task_is_metered_per_attempt_and_summed_per_tenant_and_hour(
    backends: Backends, workers: Factory, admin: Admin
) -> None:
    s = with_(
        sleepy_settings(
            all_settings(backends), sleep=SLEEP, fail_times=1, fail_code="TRANSIENT_IO", encode_seconds=0.1
        ),
        retry_backoff_seconds=0.05,
        retry_jitter=0.0,
    )
    await workers(s)
    task = await submit(backends, params=params(steps=2), max_retries=1, callback_url="https://example.invalid/hook")
    row = await wait_task(backends, task.id, is_status(Status.SUCCEEDED))

    # two attempts held the device SLEEP seconds each: the retried one's steps were all computed again (it took no
    # checkpoint), so they are metered as wasted, apart from the steps that counted
    assert (row.attempt, row.retry_count) == (2, 1)
    assert SLEEP * 0.95 <= row.device_seconds < SLEEP + 1.0
    assert SLEEP * 0.95 <= row.wasted_seconds < SLEEP + 1.0
    # a slot is held longer than the device: both attempts held theirs, the successful one also encoded (0.1 s)
    assert row.slot_seconds >= row.device_seconds + row.wasted_seconds + 0.1 * 0.95
    msg = row.to_proto()
    assert (msg.usage.gpu_seconds, msg.usage.slot_seconds) == (row.device_seconds, row.slot_seconds)

    hours = await backends.pool.fetch("SELECT * FROM usage_hour WHERE tenant_id = $1", row.user_id)
    assert [(h["model_id"], h["attempts"]) for h in hours] == [(SLEEPY, 2)]
    assert hours[0]["device_seconds"] == pytest.approx(row.device_seconds)
    assert hours[0]["slot_seconds"] == pytest.approx(row.slot_seconds)
    assert hours[0]["wasted_seconds"] == pytest.approx(row.wasted_seconds)
    assert timedelta(0) <= datetime.now(UTC) - hours[0]["hour"] < timedelta(hours=1, minutes=1)

    # TaskAdmin.GetUsage: the tenant's totals, and per hour
    got = await admin.stub.GetUsage(admin_pb2.GetUsageRequest(tenant=row.user_id), metadata=admin.admin)
    assert [(u.tenant, u.model_id, u.attempts, u.HasField("hour")) for u in got.rows] == [
        (row.user_id, SLEEPY, 2, False)
    ]
    assert got.rows[0].gpu_seconds == pytest.approx(row.device_seconds) and not got.truncated
    hourly = await admin.stub.GetUsage(admin_pb2.GetUsageRequest(by_hour=True), metadata=admin.admin)
    assert [(u.tenant, u.hour.ToDatetime(tzinfo=UTC)) for u in hourly.rows] == [(row.user_id, hours[0]["hour"])]
    before = admin_pb2.GetUsageRequest()
    before.until.FromDatetime(hours[0]["hour"])
    before.since.FromDatetime(hours[0]["hour"] - timedelta(days=1))
    assert list((await admin.stub.GetUsage(before, metadata=admin.admin)).rows) == []

    # the terminal webhook carries the task's own figures (the relay reads them with the event)
    async with backends.pool.acquire() as conn, conn.transaction():
        relayed = [r for r in await events.take_unpublished(conn, limit=100) if r.event.task_id == task.id]
    body = outbox.payload(relayed[-1], "task.succeeded")
    assert body["data"]["usage"] == {
        "gpu_seconds": row.device_seconds,
        "slot_seconds": row.slot_seconds,
        "input_tokens": 0,
        "output_tokens": 0,
    }
    assert outbox.payload(relayed[0], "task.progress")["data"]["usage"] is None


async def test_get_usage_is_admin_only_and_checks_its_fields(admin: Admin) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await admin.stub.GetUsage(admin_pb2.GetUsageRequest(), metadata=admin.user)
    assert err.value.code() is grpc.StatusCode.PERMISSION_DENIED
    bad = admin_pb2.GetUsageRequest(tenant="no spaces")
    bad.since.FromDatetime(datetime.now(UTC))
    bad.until.FromDatetime(datetime.now(UTC) - timedelta(hours=1))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await admin.stub.GetUsage(bad, metadata=admin.admin)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "tenant" in (err.value.details() or "") and "since" not in (err.value.details() or "")


async def test_a_move_by_anyone_but_the_worker_adds_no_seconds(backends: Backends) -> None:
    task = await submit(backends, params=params(steps=1))
    await claimed(backends.pool, task.id, worker_id="w1", lease_seconds=30.0)
    out = await store.release(backends.pool, task.id, actor="scheduler", reason="lease lost")
    assert out.applied and out.task is not None and (out.task.device_seconds, out.task.slot_seconds) == (0.0, 0.0)
    assert await backends.pool.fetchval("SELECT count(*) FROM usage_hour") == 0


async def test_a_budgeted_task_run_by_a_worker_is_charged_what_it_measured(
    backends: Backends, workers: Factory
) -> None:
    pool = backends.pool
    await auth.create_key(pool, backends.settings.api_key_pepper, "tenant-a")
    await tenants.update_tenant(pool, "tenant-a", max_pending=None, submits_per_minute=None, max_priority=None,
                                gpu_seconds_per_day=1000.0)
    await workers(sleepy_settings(all_settings(backends), sleep=SLEEP))
    new = NewTask(
        id=ids.new_id(), user_id="tenant-a", idempotency_key="budgeted", key_derived=False, request_hash="h",
        task_type="text-to-video", model_id=SLEEPY, prompt="p", payload=params(steps=2), metadata={}, priority=5,
        max_retries=0, callback_url=None, callback_events=[],
    )
    [admitted] = await submissions.admit(pool, [Candidate(new, None, 50.0)], default_max_pending=5)
    assert admitted.task is not None and admitted.task.gpu_reserved == 50.0
    assert await pool.fetchval("SELECT seconds FROM budget_charge WHERE tenant_id = 'tenant-a'") == 50.0
    await publish(backends, admitted.task, f"{admitted.task.id}.q0")  # as the submit service's dispatcher does
    row = await wait_task(backends, admitted.task.id, is_status(Status.SUCCEEDED))
    # the reservation became what the worker measured
    assert row.device_seconds >= SLEEP * 0.95
    assert await pool.fetchval("SELECT seconds FROM budget_charge WHERE tenant_id = 'tenant-a'") == pytest.approx(
        row.device_seconds
    )


async def test_usage_per_end_user_sums_to_the_tenants(backends: Backends, workers: Factory, admin: Admin) -> None:
    await workers(sleepy_settings(all_settings(backends), sleep=0.05))
    who = ["ann", "ann", "bob", ""]  # '' the tenant's own task
    tasks = [await submit(backends, params=params(steps=1, seed=n), end_user=eu) for n, eu in enumerate(who)]
    rows = [await wait_task(backends, t.id, is_status(Status.SUCCEEDED)) for t in tasks]
    tenant = rows[0].user_id

    async def usage(**fields: object) -> list[admin_pb2.UsageRow]:
        request = admin_pb2.GetUsageRequest(tenant=tenant, **fields)  # type: ignore[arg-type]
        return list((await admin.stub.GetUsage(request, metadata=admin.admin)).rows)

    [total] = await usage()
    per_user = {u.end_user: u for u in await usage(by_end_user=True)}
    assert set(per_user) == {"", "ann", "bob"}
    assert sum(u.gpu_seconds for u in per_user.values()) == pytest.approx(total.gpu_seconds)
    assert sum(u.attempts for u in per_user.values()) == total.attempts == 4
    assert per_user["ann"].gpu_seconds == pytest.approx(rows[0].device_seconds + rows[1].device_seconds)
    [ann] = await usage(end_user="ann")
    assert (ann.end_user, ann.attempts) == ("ann", 2) and ann.gpu_seconds == pytest.approx(per_user["ann"].gpu_seconds)
    with pytest.raises(grpc.aio.AioRpcError) as err:  # end users are each tenant's own
        await admin.stub.GetUsage(admin_pb2.GetUsageRequest(end_user="ann"), metadata=admin.admin)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT

    # the terminal webhook names the end user beside the task's own figures: what a backend bills its user from
    async with backends.pool.acquire() as conn, conn.transaction():
        relayed = [r for r in await events.take_unpublished(conn, limit=100) if r.event.task_id == tasks[2].id]
    body = outbox.payload(relayed[-1], "task.succeeded")
    assert body["data"]["end_user"] == "bob" and body["data"]["usage"]["gpu_seconds"] == rows[2].device_seconds
