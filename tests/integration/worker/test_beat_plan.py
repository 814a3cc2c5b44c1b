"""A worker's beat costs its own attempts, whatever the queue: with a deep QUEUED backlog it reads task by primary key,
even on statistics taken while nothing was queued or running (a quiet moment, when autoanalyze usually runs)."""

from __future__ import annotations

from typing import Any

from taskgate import sql
from taskgate.runtime import Backends
from tests.support import stale_stats
from tests.support.harness import plan_nodes
from tests.support.stale_stats import stale_backlog

BACKLOG = 50_000
RUNNING = 100

def _task_rows_read(plan: dict[str, Any]) -> int:
    """Every row of task the plan's scans produced or filtered out, over all their loops (EXPLAIN ANALYZE); the
    in-memory join of the beat's own attempts is not a read of the table."""
    return sum(
        round((float(n.get("Actual Rows", 0)) + float(n.get("Rows Removed by Filter", 0))) * n.get("Actual Loops", 1))
        for n in plan_nodes(plan)
        if n.get("Relation Name") == "task" and "Scan" in n["Node Type"]
    )


async def test_the_beat_reads_its_attempts_not_the_backlog_on_stale_statistics(backends: Backends) -> None:
    pool = backends.pool
    running = list(range(200_001, 200_001 + RUNNING))
    async with pool.acquire() as conn:
        await stale_backlog(conn, "QUEUED", BACKLOG)  # statistics taken while nothing was queued or running
        await conn.execute("ALTER TABLE task DISABLE TRIGGER task_event_on_insert")  # no history for fixture rows
        await conn.execute(stale_stats.ROWS, running[0], running[-1], "PROCESSING")
        await conn.execute("ALTER TABLE task ENABLE TRIGGER task_event_on_insert")
        text, *args = sql.bind(
            "worker_beat", task_ids=running, attempts=[1] * RUNNING, progress=[50] * RUNNING, lease_seconds=30.0,
            worker_id="w1", models=["wan-tiny"], slots=RUNNING, running=RUNNING, device="cpu", draining=False,
            actor="w1", control_address=None, devices=1, capacity=1.0,
        )
        undone = conn.transaction()  # the beat's effect is rolled back; its plan and its rows are what is checked
        await undone.start()
        [explained] = await conn.fetchval(f"EXPLAIN (ANALYZE, FORMAT JSON) {text}", *args)
        await undone.rollback()
    assert explained["Plan"]["Actual Rows"] == RUNNING  # every attempt renewed
    read = _task_rows_read(explained["Plan"])
    # each side reads the beat's attempts by primary key (200 rows); on the statistics' choice of
    # task_end_user_pending_idx the outer side walked every queued task on every beat (50,000)
    assert read <= 10 * RUNNING, f"{read:,} rows read for a beat of {RUNNING}"
