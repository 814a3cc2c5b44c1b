"""A soft-cancelled task its worker still runs keeps the tenant's pending slot (and its model's cap) until it lets
go."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import grpc
import pytest

from services.scheduler.scans import Action
from services.scheduler.service import Scheduler
from services.worker import service as worker_service
from taskgate import store
from taskgate.config import ModelSpec, Settings
from taskgate.runtime import Backends
from taskgate.states import Status
from taskgate.store import CancelMode
from taskgate.store import workers as registry
from taskgate_api.v1 import gateway_pb2
from tests.support.factories import all_settings, claimed, insert_task, key_for
from tests.support.harness import wait_for
from tests.support.queries import row

SLEEPY = "sleepy"


@pytest.fixture
def settings(settings: Settings) -> Settings:
    """A 'sleep' model that runs for 3 s, served by one worker slot."""
    return settings.model_copy(
        update={
            "models": {**settings.models, SLEEPY: ModelSpec(kind="sleep", sleep_seconds=3.0, default_steps=6)},
            "default_model": SLEEPY,
            "worker_models": [SLEEPY],
            "worker_slots": 1,
            "lease_seconds": 2.0,
            "heartbeat_seconds": 0.5,
            "progress_interval_seconds": 0.0,
        }
    )


@pytest.fixture
async def worker(settings: Settings) -> AsyncIterator[worker_service.WorkerHandle]:
    handle = await worker_service.start(settings)
    try:
        yield handle
    finally:
        await handle.stop(grace=0)


async def pending_of(backends: Backends, tenant: str) -> int:
    return int(
        await backends.pool.fetchval(
            "SELECT coalesce(sum(pending), 0) FROM tenant_pending WHERE tenant_id = $1", tenant
        )
    )


async def submit_code(stub: Any, md: Any, prompt: str) -> grpc.StatusCode:
    try:
        await stub.SubmitTask(gateway_pb2.SubmitTaskRequest(prompt=prompt), metadata=md, timeout=5)
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


async def test_a_soft_cancelled_run_holds_the_pending_slot_until_its_worker_lets_go(
    stub: Any, backends: Backends, worker: worker_service.WorkerHandle
) -> None:
    md = await key_for(backends, max_pending=1)
    first = await stub.SubmitTask(gateway_pb2.SubmitTaskRequest(prompt="one"), metadata=md, timeout=5)
    task_id = int(first.task.id)

    async def running() -> bool:
        r = await row(backends.pool, task_id)
        return r.status is Status.PROCESSING and r.progress > 0

    await wait_for(running, within=10)
    canceled = await stub.CancelTask(gateway_pb2.CancelTaskRequest(task_id=first.task.id), metadata=md, timeout=5)
    assert canceled.task.status == Status.CANCELED.to_proto()
    held = await row(backends.pool, task_id)
    assert held.lease_expires_at is not None  # the worker still computes it: the slot stays taken
    assert await submit_code(stub, md, "two") == grpc.StatusCode.RESOURCE_EXHAUSTED

    async def let_go() -> bool:
        return (await row(backends.pool, task_id)).lease_expires_at is None

    await wait_for(let_go, within=15)
    assert await backends.pool.fetchval("SELECT count(*) FROM reusable_result WHERE source_task_id = $1", task_id) == 1
    assert await submit_code(stub, md, "two") == grpc.StatusCode.OK


async def test_a_dead_workers_hold_lapses_and_the_scheduler_frees_the_slot(backends: Backends) -> None:
    pool = backends.pool
    scheduler = Scheduler(all_settings(backends), pool, backends.bus)
    held, other, queued = [await insert_task(pool, model_id=SLEEPY, prompt=f"p{n}") for n in range(3)]
    for task in (held, other):
        await claimed(pool, task.id, lease_seconds=10.0)
    assert await pending_of(backends, "tenant-a") == 3

    assert (await store.cancel(pool, held.id, mode=CancelMode.SOFT, actor="test")).applied
    assert (await store.cancel(pool, other.id, mode=CancelMode.HARD, actor="test")).applied
    assert (await row(backends.pool, other.id)).lease_expires_at is None
    assert await pending_of(backends, "tenant-a") == 2  # the hard cancel freed its slot at once; the soft one runs on

    # the model's concurrency cap counts the soft-cancelled run too
    capped = await registry.claim_for(
        pool, queued.id, model_id=SLEEPY, cap=1, worker_id="w2", lease_seconds=10.0, actor="w2"
    )
    assert capped.verdict is registry.Verdict.CAPPED

    lease_end = (await row(backends.pool, held.id)).lease_expires_at
    assert lease_end is not None
    assert (await scheduler.run_once(lease_end - timedelta(seconds=1)))[Action.LET_GO] == 0
    assert (await scheduler.run_once(lease_end + timedelta(seconds=1)))[Action.LET_GO] == 1  # the worker died
    after = await row(backends.pool, held.id)
    # letting go is no move
    assert (after.status, after.lease_expires_at, after.version) == (Status.CANCELED, None, held.version + 2)
    assert await pending_of(backends, "tenant-a") == 1
    assert not await store.let_go(pool, held.id, attempt=1)  # a late worker finds nothing left to let go
    taken = await registry.claim_for(
        pool, queued.id, model_id=SLEEPY, cap=1, worker_id="w2", lease_seconds=10.0, actor="w2"
    )
    assert taken.verdict is registry.Verdict.CLAIMED
