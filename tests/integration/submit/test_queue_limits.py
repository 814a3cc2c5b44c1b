"""A task's own queue limits: start_after (a delayed start: no worker takes it before) and max_queue_seconds (its queue
TTL: a task no worker took in time ends TIMEOUT QUEUE_TTL_EXPIRED, dead-lettered, instead of running late)."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta

import grpc
import pytest
from google.rpc import error_details_pb2

from services.scheduler.scans import QUEUE_TTL_EXPIRED, Action
from services.scheduler.service import Scheduler
from taskgate import store
from taskgate.config import ModelSpec, Settings
from taskgate.runtime import Backends
from taskgate.states import Status
from taskgate.store import workers as registry
from taskgate_api.v1 import gateway_pb2, gateway_pb2_grpc
from tests.support.factories import key_for
from tests.support.harness import WorkerFactory, trailing_details, wait_for
from tests.support.queries import db_now

SLEEPY = "sleepy"


def request(**fields: object) -> gateway_pb2.SubmitTaskRequest:
    return gateway_pb2.SubmitTaskRequest(prompt="a fox", model_id=SLEEPY, **fields)  # type: ignore[arg-type]


async def test_a_delayed_task_starts_no_earlier_than_its_start_after(
    settings: Settings, backends: Backends, stub: gateway_pb2_grpc.TaskGatewayAsyncStub, workers: WorkerFactory
) -> None:
    md = await key_for(backends, submits_per_minute=100, max_pending=10)
    worker_settings = settings.model_copy(update={
        "models": {**settings.models, SLEEPY: ModelSpec(kind="sleep")}, "worker_models": [SLEEPY], "worker_slots": 1,
    })
    await workers(worker_settings)  # idle: it would take the task at once
    start_after = await db_now(backends.pool) + timedelta(seconds=1.5)
    msg = request(max_queue_seconds=60.0)
    msg.start_after.FromDatetime(start_after)
    answer = await stub.SubmitTask(msg, metadata=md)
    shown = answer.task
    assert shown.start_after.ToDatetime(tzinfo=UTC) == start_after and shown.max_queue_seconds == 60.0
    # the TTL counts from the start it asked for, not from the submission
    assert shown.queue_expires_at.ToDatetime(tzinfo=UTC) == pytest.approx(start_after + timedelta(seconds=60),
                                                                           abs=timedelta(milliseconds=1))
    task_id = int(shown.id)

    async def succeeded() -> bool:
        row = await store.get_task(backends.pool, task_id)
        return row is not None and row.status is Status.SUCCEEDED

    await wait_for(succeeded, within=20)
    row = await store.get_task(backends.pool, task_id)
    assert row is not None and row.started_at is not None and row.started_at >= start_after


async def test_a_task_nobody_took_within_its_queue_ttl_times_out_with_its_own_code(
    settings: Settings, backends: Backends, stub: gateway_pb2_grpc.TaskGatewayAsyncStub
) -> None:
    md = await key_for(backends, submits_per_minute=100, max_pending=10)
    answer = await stub.SubmitTask(request(max_queue_seconds=0.2), metadata=md)
    task_id = int(answer.task.id)
    expires = answer.task.queue_expires_at.ToDatetime(tzinfo=UTC)

    async def queued_and_expired() -> bool:
        row = await store.get_task(backends.pool, task_id)
        return row is not None and row.status is Status.QUEUED and await db_now(backends.pool) > expires

    await wait_for(queued_and_expired)
    # an expired task is no worker's pick, even one whose own message arrives
    async with backends.pool.acquire() as conn:
        claim = await registry.claim_for(conn, task_id, model_id=SLEEPY, cap=0, worker_id="w1", lease_seconds=30.0,
                                         actor="test")
    assert claim.verdict is not registry.Verdict.CLAIMED
    report = await Scheduler(settings, backends.pool, backends.bus).run_once()
    assert report[Action.QUEUE_TTL] == 1
    row = await store.get_task(backends.pool, task_id)
    assert row is not None and (row.status, row.error_code) == (Status.TIMEOUT, QUEUE_TTL_EXPIRED)
    assert await backends.pool.fetchval("SELECT count(*) FROM dead_letter WHERE task_id = $1", task_id) == 1
    # a queue without a TTL of its own is not touched by it
    plain = await stub.SubmitTask(request(idempotency_key="plain"), metadata=md)
    assert not plain.task.HasField("queue_expires_at") and plain.task.max_queue_seconds == 0


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"max_queue_seconds": 0.0}, "max_queue_seconds"),
        ({"max_queue_seconds": -1.0}, "max_queue_seconds"),
        ({"max_queue_seconds": math.nan}, "max_queue_seconds"),
        ({"max_queue_seconds": 8 * 86400.0}, "max_queue_seconds"),
        ({"start_after": 8 * 86400.0}, "start_after"),  # seconds from now
        ({"start_after": "year 10000"}, "start_after"),
    ],
)
async def test_limits_out_of_range_are_refused_naming_the_field(
    backends: Backends, stub: gateway_pb2_grpc.TaskGatewayAsyncStub, fields: dict[str, object], field: str
) -> None:
    md = await key_for(backends, submits_per_minute=100, max_pending=10)
    msg = request()
    if "max_queue_seconds" in fields:
        msg.max_queue_seconds = float(fields["max_queue_seconds"])  # type: ignore[arg-type]
    elif fields["start_after"] == "year 10000":
        msg.start_after.seconds = 253402300800  # 10000-01-01: past what a datetime holds
    else:
        msg.start_after.FromDatetime(datetime.now(UTC) + timedelta(seconds=float(fields["start_after"])))  # type: ignore[arg-type]
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.SubmitTask(msg, metadata=md)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    [bad] = [d for d in trailing_details(refused.value) if isinstance(d, error_details_pb2.BadRequest)]
    assert [v.field for v in bad.field_violations] == [field]
    assert await backends.pool.fetchval("SELECT count(*) FROM task") == 0

