"""Every scheduler scan stays index-backed on a big table: no sequential scan of task, whatever its size."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import asyncpg
import pytest
from asyncpg.connection import LoggedQuery

from services.scheduler.scans import Action
from services.scheduler.service import Scheduler
from taskgate.runtime import Backends
from taskgate.states import Status
from taskgate.store import admin as admin_store
from taskgate.store import maintenance
from tests.support.factories import all_settings
from tests.support.harness import plan_nodes

# 100k tasks, mostly finished, as a long-running installation holds them; states get consistent columns.
BULK = """
INSERT INTO task (id, user_id, idempotency_key, request_hash, task_type, model_id, prompt, request_payload, priority,
                  queue_name, status, attempt, retry_count, max_retries, worker_id, lease_expires_at, started_at,
                  queued_at, finished_at, error_code, result_uri, result_sha256, result_size, cancel_mode,
                  queue_expires_at, created_at, updated_at)
SELECT i, 'tenant-' || (i % 50), 'k-' || i, md5(i::text), 'text-to-video', m, 'p', '{}', 5, m || '.5', s::task_status,
       CASE WHEN s IN ('PROCESSING', 'SUCCEEDED', 'FAILED') THEN 1 ELSE 0 END,
       CASE WHEN s = 'FAILED' THEN 3 ELSE 0 END, 3,
       CASE WHEN s = 'PROCESSING' THEN 'w' || (i % 7) END,
       CASE WHEN s = 'PROCESSING' THEN now() + make_interval(mins => (i % 20) - 5) END,  -- a quarter lapsed, the rest live for minutes
       CASE WHEN s IN ('PROCESSING', 'SUCCEEDED', 'FAILED') THEN t END,
       CASE WHEN s <> 'CREATED' THEN t END,
       CASE WHEN s IN ('SUCCEEDED', 'FAILED', 'CANCELED') THEN t END,
       CASE WHEN s = 'FAILED' THEN 'BOOM' END,
       CASE WHEN s = 'SUCCEEDED' THEN 'mem://' || i END,
       CASE WHEN s = 'SUCCEEDED' THEN md5(i::text) END,
       CASE WHEN s = 'SUCCEEDED' THEN 1000 END,
       CASE WHEN s = 'CANCELED' THEN 'soft' END,
       CASE WHEN s = 'QUEUED' AND i % 1000 < 955 THEN t END,  -- a queue TTL that ran out
       t, t
FROM (
    SELECT i,
           CASE WHEN i % 2 = 0 THEN 'wan-tiny' ELSE 'sleepy' END AS m,
           CASE WHEN i % 1000 < 900 THEN 'SUCCEEDED' WHEN i % 1000 < 950 THEN 'FAILED'
                WHEN i % 1000 < 980 THEN 'QUEUED' WHEN i % 1000 < 990 THEN 'PROCESSING'
                WHEN i % 1000 < 995 THEN 'CREATED' ELSE 'CANCELED' END AS s,
           now() - make_interval(secs => (i % 7200)) AS t
    FROM generate_series(1, 100000) AS i
) g
"""  # noqa: E501


@pytest.fixture
async def big(backends: Backends) -> Backends:
    async with backends.pool.acquire() as conn:
        await conn.execute("ALTER TABLE task DISABLE TRIGGER task_event_on_insert")  # no history for fixture rows
        await conn.execute(BULK)
        await conn.execute("ALTER TABLE task ENABLE TRIGGER task_event_on_insert")
        await conn.execute(
            "INSERT INTO dead_letter (task_id, reason) SELECT id, 'x' FROM task WHERE status = 'FAILED' AND id % 2 = 0"
        )
        await conn.execute("ANALYZE task")
        await conn.execute("ANALYZE dead_letter")
    return backends


async def test_every_scan_query_uses_an_index_on_task(big: Backends) -> None:
    s = all_settings(big)
    limit = s.scan_batch_size
    queue_timeouts = {m: s.queue_timeout_for(m) for m in s.models}
    processing_timeouts = {m: s.processing_timeout_for(m) for m in s.models}
    # each runs one statement, as the scheduler calls it; its logged SQL and arguments are what EXPLAIN checks
    scans: dict[str, Callable[[asyncpg.Connection], Awaitable[object]]] = {
        "created_due": lambda c: maintenance.created_due(c, timeout_seconds=s.created_timeout_seconds, limit=limit),
        "queue_expired": lambda c: maintenance.queue_expired(c, limit=limit),
        "queued_due": lambda c: maintenance.queued_due(
            c, timeouts=queue_timeouts, default_seconds=s.queue_timeout_seconds, limit=limit
        ),
        "lease_expired": lambda c: maintenance.lease_expired(c, limit=limit),
        "lapsed_holds": lambda c: maintenance.lapsed_holds(c, limit=limit),
        "processing_overdue": lambda c: maintenance.processing_overdue(
            c,
            timeouts=processing_timeouts,
            default_seconds=s.processing_timeout_seconds,
            grace_seconds=s.processing_grace_seconds,
            limit=limit,
        ),
        "add_missing_dead_letters": lambda c: maintenance.add_missing_dead_letters(
            c, window_seconds=s.dead_letter_window_seconds, reason="retries exhausted", limit=limit
        ),
        "purge_tasks": lambda c: maintenance.purge_tasks(c, older_than_seconds=s.retain_tasks_seconds, limit=limit),
        "purge_checkpoints": lambda c: maintenance.purge_checkpoints(c, limit=limit),
        "preempt": lambda c: maintenance.preempt(
            c, after={m: 60.0 for m in s.models}, window_seconds=s.preempt_window_seconds
        ),
        "purge_results": lambda c: maintenance.purge_results(
            c, older_than_seconds=s.retain_results_seconds, limit=limit
        ),
        "purge_previews": lambda c: maintenance.purge_previews(
            c, older_than_seconds=s.retain_results_seconds, limit=limit
        ),
        "purge_events": lambda c: maintenance.purge_events(c, older_than_seconds=s.retain_events_seconds, limit=limit),
        "unreferenced": lambda c: maintenance.unreferenced(
            c, [("tenant-2", "c81e728d9d4c2f636f067f89cc14862c", "mem://2")]
        ),
        "retention_counts": lambda c: maintenance.retention_counts(c, older_than_seconds=s.retain_tasks_seconds),
        "queue_gauges": maintenance.queue_gauges,
        "live_counts": admin_store.live_counts,
        "live_priority_counts": admin_store.live_priority_counts,
        "latest_failures": lambda c: admin_store.list_tasks(  # the dashboard's, once a second
            c,
            statuses=[Status.FAILED, Status.TIMEOUT],
            model_id=None,
            older_than_seconds=None,
            after=None,
            limit=10,
            newest_first=True,
        ),
        "oldest_queued_age": admin_store.oldest_queued_age,
    }
    assert await big.pool.fetchval("SELECT count(*) FROM task") == 100_000
    logged: asyncio.Queue[LoggedQuery] = asyncio.Queue()
    async with big.pool.acquire() as conn:
        for name, scan in scans.items():
            await scan(conn)  # asyncpg's type introspection runs (and is logged) on a connection's first use only
            with conn.query_logger(logged.put_nowait):
                await scan(conn)
            ran = await asyncio.wait_for(logged.get(), 5)
            [explained] = await conn.fetchval(f"EXPLAIN (FORMAT JSON) {ran.query}", *ran.args)
            assert logged.empty(), name  # one statement per scan query: the one explained
            on_task = [n["Node Type"] for n in plan_nodes(explained["Plan"]) if n.get("Relation Name") == "task" or
                       n.get("Index Name", "").startswith("task_")]
            assert on_task, (name, explained)
            assert "Seq Scan" not in on_task, (name, on_task)
            assert any("Index" in t for t in on_task), (name, on_task)


async def test_the_scans_still_find_their_rows_on_the_big_table(big: Backends) -> None:
    report = await Scheduler(all_settings(big), big.pool, big.bus).run_once()
    batch = all_settings(big).scan_batch_size
    assert not report.failed and report.full
    # hundreds of rows are due for each scan; each takes exactly one bounded batch per pass
    assert (report[Action.QUEUE], report[Action.QUEUE_TTL], report[Action.RELEASE]) == (batch, batch, batch)
    assert report[Action.REPUBLISH] == 0  # both models have tasks running: a queue that moves is not re-published


async def test_a_claim_reads_the_live_leases_only_however_stale_the_statistics(backends: Backends) -> None:
    """A burst of cancellations the planner's statistics have not seen yet must not make every claim walk them.

    The caps' count once read task_status_updated_idx for status = 'CANCELED' when the statistics said there were
    none: 1,500 pages and 8 ms a claim with 20,000 cancelled tasks. It reads task_live_lease_idx now.
    """
    rows = """
    INSERT INTO task (id, user_id, idempotency_key, request_hash, task_type, model_id, prompt, request_payload, priority,
                      queue_name, status, cancel_mode, queued_at, finished_at, created_at, updated_at)
    SELECT i, 'tenant', 'k-' || i, md5(i::text), 'text-to-video', 'sleepy', 'p', '{}', 5, 'sleepy.5', $1::task_status,
           CASE WHEN $1 = 'CANCELED' THEN 'soft' END, now(),
           CASE WHEN $1 = 'CANCELED' THEN now() END, now(), now()
    FROM generate_series($2::bigint, $3::bigint) AS i
    """  # noqa: E501
    async with backends.pool.acquire() as conn:
        await conn.execute("ALTER TABLE task SET (autovacuum_enabled = false)")  # the statistics stay stale
        await conn.execute("ALTER TABLE task DISABLE TRIGGER task_event_on_insert")
        await conn.execute(rows, "QUEUED", 1, 2)
        await conn.execute("ANALYZE task")  # one QUEUED task and no cancelled one, as far as the planner knows
        await conn.execute(rows, "CANCELED", 3, 20_002)
        await conn.execute("ALTER TABLE task ENABLE TRIGGER task_event_on_insert")
        await conn.execute(
            "INSERT INTO worker (id, models, slots, running, device, draining, started_at, last_heartbeat)"
            " VALUES ('w', '{sleepy}', 2, 0, 'cpu', false, now(), now())"
        )
        claim = "SELECT * FROM worker_claim({}, 'sleepy', 2, true, 'w', 10, NULL, 'a', 'r')"
        await conn.execute(claim.format(2))  # the first call in a session also reads the catalog: not what is measured
        [explained] = await conn.fetchval(
            "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + claim.format(1)
        )
        claimed = await conn.fetchrow("SELECT status::text, worker_id FROM task WHERE id = 1")
    # the fair pick (a skip scan over the level's tenants, the stride rows) reads about 60 more than the caps alone, and
    # the end users' pick inside the winning tenant (#35: its skip scan, its stride row) about 35 more (169 -> 203);
    # the look for tasks to run alone (#41, migration 0047: one probe of their empty index, and the checks it gates)
    # about 40 more on this second call of a session (242 -> 283), most of it planning: each statement runs in 1-4
    # blocks
    assert explained["Plan"]["Shared Hit Blocks"] + explained["Plan"].get("Shared Read Blocks", 0) < 300, explained
    assert (claimed["status"], claimed["worker_id"]) == ("PROCESSING", "w")  # under both caps: claimed


async def test_a_fair_claim_reads_one_task_per_tenant_however_long_the_queue(backends: Backends) -> None:
    """The claim's fair pick walks the tenants of a level (task_fair_idx), never a tenant's whole backlog."""
    rows = """
    INSERT INTO task (id, user_id, idempotency_key, request_hash, task_type, model_id, prompt, request_payload, priority,
                      queue_name, status, queued_at, created_at, updated_at)
    SELECT i, $1, 'k-' || i, md5(i::text), 'text-to-video', 'sleepy', 'p', '{}', 5, 'sleepy.5', 'QUEUED',
           now() + make_interval(secs => i), now(), now()
    FROM generate_series($2::bigint, $3::bigint) AS i
    """  # noqa: E501
    async with backends.pool.acquire() as conn:
        await conn.execute("ALTER TABLE task DISABLE TRIGGER task_event_on_insert")
        await conn.execute(rows, "bulk", 1, 20_000)
        await conn.execute(rows, "single", 20_001, 20_001)
        await conn.execute("ALTER TABLE task ENABLE TRIGGER task_event_on_insert")
        await conn.execute("ANALYZE task")
        claim = "SELECT * FROM worker_claim({}, 'sleepy', 0, false, 'w', 10, NULL, 'a', 'r')"
        await conn.execute(claim.format(20_001))  # bulk's oldest; the first call in a session also reads the catalog
        [explained] = await conn.fetchval("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + claim.format(20_001))
        claimed = await conn.fetch("SELECT id FROM task WHERE status = 'PROCESSING' ORDER BY id")
    assert [r["id"] for r in claimed] == [1, 20_001]  # the single task second, ahead of bulk's 19,999
    # a constant per claim: the end users' pick inside the winning tenant (#35) added about 40 (171 -> 212); a walk of
    # bulk's backlog would read thousands; the look for tasks to run alone (#41) about 25 more (248 -> 274)
    assert explained["Plan"]["Shared Hit Blocks"] + explained["Plan"].get("Shared Read Blocks", 0) < 300, explained
