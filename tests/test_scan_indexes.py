"""Every scheduler scan stays index-backed on a big table: no sequential scan of task, whatever its size."""

from __future__ import annotations

from typing import Any

import pytest

from services.scheduler.scans import Action
from services.scheduler.service import Scheduler
from taskgate import sql
from taskgate.runtime import Backends

# 100k tasks, mostly finished, as a long-running installation holds them; states get consistent columns.
BULK = """
INSERT INTO task (id, user_id, idempotency_key, request_hash, task_type, model_id, prompt, request_payload, priority,
                  queue_name, status, attempt, retry_count, max_retries, worker_id, lease_expires_at, started_at,
                  queued_at, finished_at, error_code, result_uri, result_sha256, result_size, cancel_mode,
                  created_at, updated_at)
SELECT i, 'tenant-' || (i % 50), 'k-' || i, md5(i::text), 'text-to-video', m, 'p', '{}', 5, m || '.5', s::task_status,
       CASE WHEN s IN ('PROCESSING', 'SUCCEEDED', 'FAILED') THEN 1 ELSE 0 END,
       CASE WHEN s = 'FAILED' THEN 3 ELSE 0 END, 3,
       CASE WHEN s = 'PROCESSING' THEN 'w' || (i % 7) END,
       CASE WHEN s = 'PROCESSING' THEN now() + make_interval(secs => (i % 20) - 5) END,
       CASE WHEN s IN ('PROCESSING', 'SUCCEEDED', 'FAILED') THEN t END,
       CASE WHEN s <> 'CREATED' THEN t END,
       CASE WHEN s IN ('SUCCEEDED', 'FAILED', 'CANCELED') THEN t END,
       CASE WHEN s = 'FAILED' THEN 'BOOM' END,
       CASE WHEN s = 'SUCCEEDED' THEN 'mem://' || i END,
       CASE WHEN s = 'SUCCEEDED' THEN md5(i::text) END,
       CASE WHEN s = 'SUCCEEDED' THEN 1000 END,
       CASE WHEN s = 'CANCELED' THEN 'soft' END,
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
"""


def _nodes(plan: dict[str, Any]) -> list[dict[str, Any]]:
    out = [plan]
    for child in plan.get("Plans", []):
        out += _nodes(child)
    return out


@pytest.fixture
async def big(backends: Backends) -> Backends:
    async with backends.pool.acquire() as conn:
        await conn.execute("ALTER TABLE task DISABLE TRIGGER task_event_on_insert")  # no history for fixture rows
        await conn.execute(BULK)
        await conn.execute("ALTER TABLE task ENABLE TRIGGER task_event_on_insert")
        await conn.execute("INSERT INTO dead_letter (task_id, reason) SELECT id, 'x' FROM task WHERE status = 'FAILED' AND id % 2 = 0")
        await conn.execute("ANALYZE task")
        await conn.execute("ANALYZE dead_letter")
    return backends


async def test_every_scan_query_uses_an_index_on_task(big: Backends) -> None:
    s = big.settings
    models = sorted(s.models)
    queue_timeouts = [s.queue_timeout_for(m) for m in models]
    processing_timeouts = [s.processing_timeout_for(m) for m in models]
    scans: dict[str, tuple[object, ...]] = {
        "sched_created_due": (None, s.created_timeout_seconds, s.scan_batch_size),
        "sched_queued_due": (None, models, queue_timeouts, s.queue_timeout_seconds, min(queue_timeouts), s.scan_batch_size),
        "sched_lease_expired": (None, s.scan_batch_size),
        "sched_processing_overdue": (
            None, models, processing_timeouts, s.processing_timeout_seconds, s.processing_grace_seconds, s.scan_batch_size,
        ),
        "sched_dead_letter_missing": (None, s.dead_letter_window_seconds, "retries exhausted", s.scan_batch_size),
        "sched_queue_gauges": (),
        "admin_live_counts": (),
        "admin_oldest_queued_age": (),
    }
    assert await big.pool.fetchval("SELECT count(*) FROM task") == 100_000
    for name, args in scans.items():
        [explained] = await big.pool.fetchval(f"EXPLAIN (FORMAT JSON) {sql.query(name)}", *args)
        on_task = [n["Node Type"] for n in _nodes(explained["Plan"]) if n.get("Relation Name") == "task" or
                   n.get("Index Name", "").startswith("task_")]
        assert on_task, (name, explained)
        assert "Seq Scan" not in on_task, (name, on_task)
        assert any("Index" in t for t in on_task), (name, on_task)


async def test_the_scans_still_find_their_rows_on_the_big_table(big: Backends) -> None:
    report = await Scheduler(big.settings, big.pool, big.bus).run_once()
    batch = big.settings.scan_batch_size
    assert not report.failed and report.full
    # hundreds of rows are due for each scan; each takes exactly one bounded batch per pass
    assert (report[Action.QUEUE], report[Action.REPUBLISH], report[Action.RELEASE]) == (batch, batch, batch)
