"""A poll costs the same however long the queue: GetTask of a queued task behind 100,000 others is one primary-key
read (the position and ETA come from the process's shared queue snapshot, taskgate/queueview.py), and the snapshot
gives the very answers the per-task statement gave (eta_inputs), fair share, weights and slots included."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import grpc
import pytest
from asyncpg.connection import LoggedQuery

from services.submit import service as submit_service
from taskgate import eta, queueview, sql, store
from taskgate.config import Settings
from taskgate.runtime import Backends
from taskgate.states import Priority
from taskgate.store import estimates, workers
from taskgate_api.v1 import gateway_pb2, gateway_pb2_grpc
from tests.support.factories import claim, claimed, finished_runs, key_for, queued
from tests.support.harness import plan_nodes, wait_for

BACKLOG = 100_000

# tenant-a's 100,000 due QUEUED tasks of wan-tiny at NORMAL, queued a minute ago in id order (no history rows)
BULK = """
INSERT INTO task (id, user_id, idempotency_key, request_hash, task_type, model_id, prompt, request_payload, priority,
                  queue_name, status, attempt, queued_at, created_at, updated_at)
SELECT i, 'tenant-a', 'bulk-' || i, md5(i::text), 'text-to-video', 'wan-tiny', 'p',
       '{"num_frames": 9, "width": 32, "height": 32}'::jsonb, 5, 'wan-tiny.5', 'QUEUED', 0,
       now() - interval '60 seconds' + make_interval(secs => i / 1000000.0), now() - interval '61 seconds',
       now() - interval '60 seconds'
FROM generate_series(1, $1::int) AS i
"""


class Recorder:
    """Every statement any connection of a pool runs while `on` (a query logger on each connection it can hand out)."""

    def __init__(self) -> None:
        self.on = False
        self.logged: list[LoggedQuery] = []

    def __call__(self, query: LoggedQuery) -> None:
        if self.on:
            self.logged.append(query)

    async def attach(self, pool: Any) -> None:
        held = [await pool.acquire(timeout=10) for _ in range(pool.get_max_size())]  # opens every connection
        for conn in held:
            conn.add_query_logger(self)
        for conn in held:
            await pool.release(conn)


async def _rows_touched(conn: Any, query: str, args: Any) -> int:
    """The most rows any node of the statement's plan produced or scanned (EXPLAIN ANALYZE)."""
    [explained] = await conn.fetchval(f"EXPLAIN (ANALYZE, FORMAT JSON) {query}", *args)
    return max(
        int(n.get("Actual Rows", 0)) + int(n.get("Rows Removed by Filter", 0)) for n in plan_nodes(explained["Plan"])
    )


@pytest.fixture
async def deep(settings: Settings, backends: Backends) -> AsyncIterator[tuple[Settings, Backends]]:
    async with backends.pool.acquire() as conn:
        await conn.execute("ALTER TABLE task DISABLE TRIGGER task_event_on_insert")  # no history for fixture rows
        await conn.execute(BULK, BACKLOG)
        await conn.execute("ALTER TABLE task ENABLE TRIGGER task_event_on_insert")
        await conn.execute("ANALYZE task")
    yield settings.model_copy(update={"eta_snapshot_seconds": 60.0}), backends


async def test_a_poll_behind_100000_queued_tasks_is_one_primary_key_read(deep: tuple[Settings, Backends]) -> None:
    settings, backends = deep
    pool = backends.pool
    await workers.register(pool, workers.Registration("w-live", ("wan-tiny",), 2, 0, "cpu", False))
    await finished_runs(pool, [10.0])  # a LOW level run: NORMAL's backlog stays whole
    behind = [await queued(pool) for _ in range(3)]  # tenant-a's, after the backlog
    handle = await submit_service.start(settings, backends)
    md = await key_for(backends)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
            stub = gateway_pb2_grpc.TaskGatewayStub(channel)

            async def get(task_id: int) -> Any:
                return (
                    await stub.GetTask(gateway_pb2.GetTaskRequest(task_id=str(task_id)), metadata=md, timeout=30)
                ).task

            first = await get(behind[0])  # the first poll reads the snapshot (and the key, the class's history)
            assert first.queue_position == BACKLOG + 1 and first.HasField("estimated_start")
            recorder = Recorder()
            await recorder.attach(pool)
            recorder.on = True
            polled = [await get(task_id) for task_id in [*behind, 1, BACKLOG // 2, BACKLOG] * 5]
            recorder.on = False
    finally:
        await handle.stop(0)
    logged = recorder.logged
    assert [t.queue_position for t in polled[:6]] == [BACKLOG + 1, BACKLOG + 2, BACKLOG + 3, 1, BACKLOG // 2, BACKLOG]
    # 30 polls, 30 reads of the task's row by its primary key; besides them only the API key's lookup (its cache
    # expires) and asyncpg's own type introspection on a fresh connection; each of ours reads a row or so
    ours = [q for q in logged if q.query.startswith("/*")]
    assert [q.query for q in ours if q.query == sql.query("get_task")] == [sql.query("get_task")] * len(polled)
    assert {q.query for q in ours} <= {sql.query("get_task"), sql.query("lookup_api_key")}, [q.query[:40] for q in ours]
    async with pool.acquire() as conn:
        for query in {q.query: q for q in ours}.values():
            assert await _rows_touched(conn, query.query, query.args) <= 1, query.query
        # what a poll ran before: the per-task statement, whose cost was the backlog's
        ids = [behind[-1]]
        per_task = sql.bind(
            "eta_inputs", task_ids=ids, window_seconds=86400.0, max_runs=20, alive_seconds=10.0, weights=[6, 3, 1]
        )
        old = await conn.fetch(*per_task)
        assert old and await _rows_touched(conn, per_task[0], per_task[1:]) >= BACKLOG


async def test_the_snapshot_gives_the_answers_of_the_per_task_statement(settings: Settings, backends: Backends) -> None:
    pool = backends.pool
    await workers.register(pool, workers.Registration("w-two", ("wan-tiny", "sleepy"), 3, 0, "cpu", False))
    await workers.register(pool, workers.Registration("w-one", ("wan-tiny",), 1, 0, "cpu", False))
    await pool.execute("INSERT INTO tenant (id, share_weight) VALUES ('tenant-b', 3) "
                       "ON CONFLICT (id) DO UPDATE SET share_weight = 3")
    await finished_runs(pool, [6.0, 8.0])
    await finished_runs(pool, [3.0], model_id="sleepy")
    tasks = []
    for i in range(6):  # three tenants, three levels, two models
        tasks.append(await queued(pool, user_id="tenant-a"))
        tasks.append(await queued(pool, user_id="tenant-b"))
        tasks.append(await queued(pool, user_id="tenant-c", priority=Priority.HIGH if i % 2 else Priority.NORMAL))
        tasks.append(await queued(pool, user_id="tenant-b", priority=Priority.LOW))
        tasks.append(await queued(pool, user_id="tenant-c", model_id="sleepy"))
    # passes advance as real claims advance them; one task is not due yet
    for _ in range(4):
        claim = await claimed_any(pool, tasks)
        tasks.remove(claim)
    await pool.execute("UPDATE task SET not_before = now() + interval '1 hour' WHERE id = $1", tasks[7])
    view = queueview.QueueView(pool, settings)
    old = await eta.estimates(pool, tasks, settings)
    rows = await estimates.eta_inputs(pool, tasks, window_seconds=settings.eta_history_seconds,
                                      max_runs=settings.eta_history_runs, alive_seconds=settings.lease_seconds,
                                      weights=settings.priority_weights)
    snapshot = await view._fresh()
    for task_id in tasks:
        row = await store.get_task(pool, task_id)
        assert row is not None
        new = await view.estimate(row)
        assert new is not None and new.queue_position == old[task_id].queue_position, task_id
        mine = snapshot.inputs(
            row, estimates.RunHistory(rows[task_id].run_seconds, rows[task_id].runs), rows[task_id].now
        )
        assert (mine.level_position, dict(mine.queued), round(mine.slots, 9)) == (
            rows[task_id].level_position, dict(rows[task_id].queued), round(rows[task_id].slots, 9)), task_id
        new_start, old_start = new.start, old[task_id].start
        assert new_start is not None and old_start is not None
        assert abs(new_start - old_start) < timedelta(seconds=2)  # read a moment apart


async def claimed_any(pool: Any, tasks: list[int]) -> int:
    """Claims through the real claim on a message naming tasks[0]'s level; returns the task the claim took."""
    got = await claim(pool, tasks[0], worker_id="w-claims")
    assert got.task is not None
    return got.task.id


async def test_a_poll_sees_the_queue_move_within_the_snapshot_period(settings: Settings, backends: Backends) -> None:
    pool = backends.pool
    first, second = await queued(pool), await queued(pool)
    handle = await submit_service.start(settings.model_copy(update={"eta_snapshot_seconds": 0.2}), backends)
    md = await key_for(backends)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
            stub = gateway_pb2_grpc.TaskGatewayStub(channel)

            async def position() -> int:
                resp = await stub.GetTask(gateway_pb2.GetTaskRequest(task_id=str(second)), metadata=md, timeout=10)
                return int(resp.task.queue_position)

            assert await position() == 2
            await claimed(pool, first)
            await wait_for(lambda: _is(position(), 1), within=5)
    finally:
        await handle.stop(0)


async def _is(value: Any, expected: int) -> bool:
    return bool(await value == expected)


@pytest.mark.parametrize("payload", [
    {}, {"num_frames": 9, "width": 32, "height": 32}, {"num_frames": 17, "width": 64, "height": 64},
    {"num_frames": 16, "width": 64, "height": 64}, {"num_frames": 8.5, "width": 30.25, "height": 1},
    {"num_frames": True, "width": "64", "height": 2}, {"num_frames": -3, "width": 5, "height": 5},
    {"num_frames": 0.3, "width": 1, "height": 1}, {"num_frames": 2**40, "width": 3, "height": 1},
])
async def test_the_size_class_is_the_databases(backends: Backends, payload: dict[str, Any]) -> None:
    expected = await backends.pool.fetchval("SELECT task_size_class($1::jsonb)", payload)
    assert queueview.size_class(payload) == expected


async def test_a_failed_snapshot_read_is_answered_as_an_error_and_read_again(
    settings: Settings, backends: Backends
) -> None:
    pool = backends.pool
    task_id = await queued(pool)
    row = await store.get_task(pool, task_id)
    assert row is not None
    view = queueview.QueueView(pool, settings)
    await pool.execute("ALTER TABLE fair_level RENAME TO fair_level_away")
    try:
        with pytest.raises(Exception, match="fair_level"):
            await view.estimate(row)
    finally:
        await pool.execute("ALTER TABLE fair_level_away RENAME TO fair_level")
    found = await asyncio.wait_for(view.estimate(row), 10)
    assert found is not None and found.queue_position == 1
