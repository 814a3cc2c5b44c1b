"""Dispatch off the answer's path, against real PostgreSQL, NATS and gRPC: the answer follows the admission commit,
the dispatcher publishes and queues after it, a crash between its publish and its QUEUED move loses nothing, and each
caller's deadline is its own."""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta
from typing import Any

import asyncpg
import grpc

from services.scheduler.scans import Action
from services.scheduler.service import Scheduler
from services.submit.service import SubmitHandle
from taskgate import bus as busmod
from taskgate import store
from taskgate.dispatcher import Dispatcher, dispatch_pass
from taskgate.runtime import Backends
from taskgate.states import Status
from taskgate.store import submissions
from taskgate.store.workers import Verdict
from taskgate_api.v1 import gateway_pb2, gateway_pb2_grpc
from tests.support.factories import all_settings, claim, insert_task, key_for
from tests.support.harness import wait_for


async def _status(pool: asyncpg.Pool, task_id: int) -> Status:
    task = await store.get_task(pool, task_id)
    assert task is not None
    return task.status


async def _messages(bus: busmod.Bus) -> int:
    return int((await bus.js.stream_info(busmod.TASKS_STREAM)).state.messages)


class _DiesAfterPublish:
    """JetStream whose publishes land, after which the dispatcher's database connection is gone: a dispatcher that
    crashed between its publish and its QUEUED move."""

    def __init__(self, js: Any, conn: asyncpg.Connection) -> None:
        self._js = js
        self._conn = conn

    async def publish_async(self, subject: str, payload: bytes, **kwargs: Any) -> Any:
        ack = await self._js.publish_async(subject, payload, **kwargs)
        self._conn.terminate()
        return ack


async def test_a_dispatcher_crash_between_publish_and_queued_loses_nothing_and_runs_once(backends: Backends) -> None:
    pool, settings = backends.pool, all_settings(backends)
    task = await insert_task(pool)
    conn = await asyncpg.connect(backends.database_url)
    dying = busmod.Bus(nc=backends.bus.nc, js=_DiesAfterPublish(backends.bus.js, conn))  # type: ignore[arg-type]
    try:
        await dispatch_pass(conn, dying, [task], actor="submit", reason="dispatched", ack_timeout=5.0, within=5.0)
    except asyncpg.InterfaceError:
        pass  # the QUEUED move never ran
    else:
        raise AssertionError("the pass should have lost its connection")
    assert await _status(pool, task.id) is Status.CREATED and await _messages(backends.bus) == 1

    # the scheduler's scan repeats the very same pass: the repeat publish is deduplicated, the task moves to QUEUED
    scheduler = Scheduler(settings, pool, backends.bus)
    later = await pool.fetchval("SELECT now()") + timedelta(seconds=settings.created_timeout_seconds + 1)
    report = await scheduler.run_once(later)
    assert report[Action.QUEUE] == 1 and await _status(pool, task.id) is Status.QUEUED
    assert await _messages(backends.bus) == 1

    # one claim wins, the second (a redelivery, or the same message twice) is refused
    first = await claim(pool, task.id, worker_id="w1", lease_seconds=10.0)
    second = await claim(pool, task.id, worker_id="w2", lease_seconds=10.0)
    assert (first.verdict, second.verdict) == (Verdict.CLAIMED, Verdict.REFUSED)


async def test_the_dispatcher_queues_each_handed_batch_in_one_pass(backends: Backends) -> None:
    pool = backends.pool
    tasks = [await insert_task(pool) for _ in range(5)]
    dispatcher = Dispatcher(pool, backends.bus, actor="submit", ack_timeout=5.0, db_timeout=5.0, max_batch=1000)
    dispatcher.hand(tasks[:3])
    dispatcher.hand(tasks[3:])
    try:
        await wait_for(lambda: _all_queued(pool, [t.id for t in tasks]))
    finally:
        await dispatcher.close(5.0)
    assert await _messages(backends.bus) == 5
    actors = await pool.fetch("SELECT DISTINCT actor FROM task_event WHERE to_status = 'QUEUED'")
    assert [r[0] for r in actors] == ["submit"]


async def test_the_queued_move_skips_a_task_whose_claim_is_under_way_instead_of_waiting(backends: Backends) -> None:
    """The message outran the move and a worker's claim holds the row until its durable commit: the move leaves that
    task alone at once (the claim takes it from CREATED) and queues the rest of its pass."""
    pool = backends.pool
    held, free = await insert_task(pool), await insert_task(pool)
    async with pool.acquire() as claiming, claiming.transaction():
        await claiming.execute("SELECT 1 FROM task WHERE id = $1 FOR UPDATE", held.id)  # the claim, not yet committed
        began = time.monotonic()
        moved = await submissions.queue_created(pool, [held, free], actor="submit", within=5.0)
        waited = time.monotonic() - began
        assert [t.id for t in moved] == [free.id] and waited < 5.0
    assert (await _status(pool, held.id), await _status(pool, free.id)) == (Status.CREATED, Status.QUEUED)


async def _all_queued(pool: asyncpg.Pool, ids: list[int]) -> bool:
    n = await pool.fetchval("SELECT count(*) FROM task WHERE id = ANY($1::bigint[]) AND status = 'QUEUED'", ids)
    return bool(n == len(ids))


async def test_a_tenant_flooding_tiny_deadlines_neither_fails_nor_delays_another(
    gateway: SubmitHandle, backends: Backends
) -> None:
    flooder = await key_for(backends, "flooder", max_pending=10_000, submits_per_minute=100_000)
    patient = await key_for(backends, "patient", max_pending=10_000, submits_per_minute=100_000)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
        stub = gateway_pb2_grpc.TaskGatewayStub(channel)

        async def call(md: Any, i: int, deadline: float) -> tuple[grpc.StatusCode, float]:
            began = time.perf_counter()
            try:
                await stub.SubmitTask(gateway_pb2.SubmitTaskRequest(prompt=f"p {i}"), metadata=md, timeout=deadline)
            except grpc.aio.AioRpcError as exc:
                return exc.code(), time.perf_counter() - began
            return grpc.StatusCode.OK, time.perf_counter() - began

        alone = [await call(patient, -i, 5.0) for i in range(1, 6)]  # warm: the channel and the key cache
        assert all(code == grpc.StatusCode.OK for code, _ in alone)
        flood = [asyncio.create_task(call(flooder, i, 0.001 + (i % 20) / 1000)) for i in range(400)]
        patient_calls = [asyncio.create_task(call(patient, i, 5.0)) for i in range(40)]
        flooded = await asyncio.gather(*flood)
        served = await asyncio.gather(*patient_calls)
    # the flooder hears its own deadline (or succeeds when it was quick enough), never another failure
    assert {code for code, _ in flooded} <= {grpc.StatusCode.OK, grpc.StatusCode.DEADLINE_EXCEEDED}
    assert [code for code, _ in served] == [grpc.StatusCode.OK] * 40
    # no patient call waited on a flooder's statement timing out (which would take a full statement timeout)
    assert max(seconds for _, seconds in served) < backends.settings.submit_db_timeout_seconds / 5
    await wait_for(lambda: _none_created(backends.pool))
    assert await _messages(backends.bus) == await backends.pool.fetchval("SELECT count(*) FROM task")


async def _none_created(pool: asyncpg.Pool) -> bool:
    return bool(await pool.fetchval("SELECT count(*) FROM task WHERE status = 'CREATED'") == 0)
