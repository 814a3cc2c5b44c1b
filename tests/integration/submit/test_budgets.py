"""GPU-second budgets at admission: an estimate reserved in the admission statement under the tenant lock, refused
with QUOTA_EXCEEDED when it does not fit the UTC day or month (RetryInfo until the window resets), reset by the clock
(injected: the statement's `now`), trued up to the measured seconds when the task ends, released by a cancel."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2

from taskgate import auth, ids, store
from taskgate.runtime import Backends
from taskgate.store import pool, submissions, tenants
from taskgate.store.submissions import Admission, AdmitVerdict, Candidate, History, NewTask
from taskgate_api.v1 import gateway_pb2
from tests.support.factories import claimed, key_for
from tests.support.harness import info_of, outcome

PAYLOAD = {"num_frames": 9, "width": 32, "height": 32, "num_inference_steps": 2, "seed": 1}
LATE = datetime(2026, 3, 10, 23, 0, tzinfo=UTC)  # an hour before the day's budget resets
NEXT_DAY = datetime(2026, 3, 11, 0, 0, 1, tzinfo=UTC)


def candidate(tenant: str, key: str, estimate: float = 40.0, **payload: Any) -> Candidate:
    new = NewTask(
        id=ids.new_id(),
        user_id=tenant,
        idempotency_key=key,
        key_derived=False,
        request_hash=key,
        task_type="text-to-video",
        model_id="wan-tiny",
        prompt=key,
        payload=PAYLOAD | payload,
        metadata={},
        priority=5,
        max_retries=0,
        callback_url=None,
        callback_events=[],
    )
    return Candidate(new, None, estimate)


async def admit(backends: Backends, *items: Candidate, now: datetime) -> list[Admission]:
    return await submissions.admit(backends.pool, items, default_max_pending=50, history=History(), now=now)


async def charged(backends: Backends, tenant: str) -> dict[str, float]:
    rows = await backends.pool.fetch("SELECT day, seconds FROM budget_charge WHERE tenant_id = $1 ORDER BY day", tenant)
    return {str(r["day"]): r["seconds"] for r in rows}


async def budget(backends: Backends, tenant: str, *, day: float | None = None, month: float | None = None) -> None:
    await auth.create_key(backends.pool, backends.settings.api_key_pepper, tenant)
    changed = await tenants.update_tenant(
        backends.pool, tenant, max_pending=None, submits_per_minute=None, max_priority=None, gpu_seconds_per_day=day,
        gpu_seconds_per_month=month,
    )
    assert changed is not None and (changed.gpu_seconds_per_day, changed.gpu_seconds_per_month) == (day, month)


async def test_the_day_budget_refuses_what_does_not_fit_until_midnight_utc(backends: Backends) -> None:
    await budget(backends, "metered", day=100.0)
    got = await admit(
        backends, candidate("metered", "k1"), candidate("metered", "k2"), candidate("metered", "k3"),
        candidate("metered", "k4", estimate=10.0, width=8, height=8), candidate("metered", "k3"), now=LATE,
    )
    # one by one: 40 + 40 fit, the third 40 does not (20 left) and reserves nothing, so a smaller size's 10 after it
    # fits (an estimate is per model, task type and size class)
    assert [a.verdict for a in got] == [
        AdmitVerdict.CREATED,
        AdmitVerdict.CREATED,
        AdmitVerdict.QUOTA_EXCEEDED,
        AdmitVerdict.CREATED,
        AdmitVerdict.QUOTA_EXCEEDED,
    ]
    refused = got[2]
    assert refused.budget is not None and (refused.budget.window, refused.budget.left, refused.budget.estimate) == (
        "day",
        20.0,
        40.0,
    )
    assert refused.retry_after == pytest.approx(3600.0)  # until 00:00 UTC
    assert got[4].budget == refused.budget  # a later copy of the key shares its first copy's answer
    assert [a.task.gpu_reserved for a in got if a.task] == [40.0, 40.0, 10.0]
    assert await charged(backends, "metered") == {"2026-03-10": 90.0}

    # an accepted request retried while over budget gets its task; a new one is still refused
    again = await admit(backends, candidate("metered", "k1"), candidate("metered", "k5"), now=LATE)
    assert [a.verdict for a in again] == [AdmitVerdict.EXISTING, AdmitVerdict.QUOTA_EXCEEDED]
    assert again[0].task is not None and again[0].task.id == got[0].task.id  # type: ignore[union-attr]

    # the day resets at midnight UTC: the refused one fits now, charged to its own day
    after = await admit(backends, candidate("metered", "k3"), now=NEXT_DAY)
    assert after[0].verdict is AdmitVerdict.CREATED
    assert await charged(backends, "metered") == {"2026-03-10": 90.0, "2026-03-11": 40.0}


async def test_the_month_budget_counts_every_day_of_the_month(backends: Backends) -> None:
    await budget(backends, "monthly", day=100.0, month=120.0)
    assert [
        a.verdict for a in await admit(backends, candidate("monthly", "a"), candidate("monthly", "b"), now=LATE)
    ] == [AdmitVerdict.CREATED, AdmitVerdict.CREATED]
    [next_day] = await admit(backends, candidate("monthly", "c"), now=NEXT_DAY)
    assert next_day.verdict is AdmitVerdict.CREATED  # 120 of 120 this month, 40 of 100 this day
    [over] = await admit(backends, candidate("monthly", "e"), now=NEXT_DAY)
    assert over.verdict is AdmitVerdict.QUOTA_EXCEEDED and over.budget is not None
    assert (over.budget.window, over.budget.left) == ("month", 0.0)
    assert over.retry_after == pytest.approx((datetime(2026, 4, 1, tzinfo=UTC) - NEXT_DAY).total_seconds())
    [april] = await admit(backends, candidate("monthly", "e"), now=datetime(2026, 4, 1, 0, 0, 1, tzinfo=UTC))
    assert april.verdict is AdmitVerdict.CREATED


async def test_the_charge_is_trued_up_to_the_measured_seconds_and_a_cancel_releases_it(backends: Backends) -> None:
    await budget(backends, "settled", day=1000.0)
    ran, dropped = await admit(backends, candidate("settled", "ran"), candidate("settled", "dropped"), now=LATE)
    assert ran.task is not None and dropped.task is not None
    assert await charged(backends, "settled") == {"2026-03-10": 80.0}
    # the worker's final write records 7.5 measured GPU-seconds: the charge becomes what it measured
    await claimed(backends.pool, ran.task.id, worker_id="w1", lease_seconds=30.0)
    result = store.ResultRef("mem://x", "video/mp4", 1, "ab" * 32)
    out = await store.succeed(backends.pool, ran.task.id, attempt=1, result=result, actor="test",
                              metered=store.Metered(7.5, 8.0))
    assert out.applied
    assert await charged(backends, "settled") == {"2026-03-10": pytest.approx(47.5)}
    # a task cancelled before it ran releases its reservation
    await store.cancel(backends.pool, dropped.task.id, mode=store.CancelMode.SOFT, actor="test")
    assert await charged(backends, "settled") == {"2026-03-10": pytest.approx(7.5)}
    # the next estimate of that model and size comes from the metered history (7.5), not the model's default
    [next_one] = await admit(backends, candidate("settled", "next"), now=LATE)
    assert next_one.task is not None and next_one.task.gpu_reserved == 7.5


async def test_two_replicas_admitting_at_once_never_overdraw_the_gpu_budget(backends: Backends) -> None:
    await budget(backends, "racer", day=40.0 * 5)
    assert backends.settings.database_url is not None
    other = await pool.create_pool(backends.settings.database_url, size=2)  # a second replica's own connections
    try:
        batches = [[candidate("racer", f"{r}-{i}") for i in range(4)] for r in range(4)]
        got = await asyncio.gather(*(
            submissions.admit(backends.pool if n % 2 else other, b, default_max_pending=50, history=History(), now=LATE)
            for n, b in enumerate(batches)
        ))
    finally:
        await other.close()
    verdicts = [a.verdict for batch in got for a in batch]
    # each statement reads the charges after the tenant lock it waited for (the lock is a statement of its own)
    assert verdicts.count(AdmitVerdict.CREATED) == 5 and verdicts.count(AdmitVerdict.QUOTA_EXCEEDED) == 11
    assert await charged(backends, "racer") == {"2026-03-10": 200.0}


async def test_a_tenant_without_a_budget_reserves_nothing(backends: Backends) -> None:
    await auth.create_key(backends.pool, backends.settings.api_key_pepper, "free")
    [free] = await admit(backends, candidate("free", "k", estimate=1e9), now=LATE)
    assert free.verdict is AdmitVerdict.CREATED and free.task is not None and free.task.gpu_reserved == 0
    assert await backends.pool.fetchval("SELECT count(*) FROM budget_charge") == 0


async def test_quota_exceeded_over_grpc_names_what_is_left_and_when_it_resets(stub: Any, backends: Backends) -> None:
    md = await key_for(backends, "grpc-budget")
    await budget(backends, "grpc-budget", day=1000.0)
    accepted = await stub.SubmitTask(
        gateway_pb2.SubmitTaskRequest(prompt="kept", idempotency_key="kept"), metadata=md, timeout=5
    )
    assert accepted.created
    # the budget is lowered below what is charged: the accepted request's retry still gets its task ...
    await budget(backends, "grpc-budget", day=30.0)
    again = await stub.SubmitTask(
        gateway_pb2.SubmitTaskRequest(prompt="kept", idempotency_key="kept"), metadata=md, timeout=5
    )
    assert (again.task.id, again.created) == (accepted.task.id, False)
    # ... and a new one is refused with what is left, its estimate (the model's default) and when the day resets
    code, details, _ = await outcome(
        stub.SubmitTask(gateway_pb2.SubmitTaskRequest(prompt="new"), metadata=md, timeout=5)
    )
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    info = info_of(details)
    estimate = backends.settings.models["wan-tiny"].gpu_seconds_estimate
    assert info.reason == "QUOTA_EXCEEDED"
    assert dict(info.metadata) == {
        "budget": "gpu_seconds", "window": "day", "gpu_seconds_left": "0.000", "gpu_seconds_estimate": f"{estimate:.3f}"
    }
    retry = next(d for d in details if isinstance(d, error_details_pb2.RetryInfo))
    assert 0 < retry.retry_delay.ToTimedelta().total_seconds() <= 86400
