"""The dispatcher's CREATED -> QUEUED move costs its own pass, whatever the backlog: after a bulk burst it reads task by
primary key, even on statistics taken while no task was CREATED (the usual state: every created task is queued within
milliseconds)."""

from __future__ import annotations

from typing import Any

from taskgate import sql
from taskgate.runtime import Backends
from tests.support.harness import plan_nodes
from tests.support.stale_stats import stale_backlog

BACKLOG = 20_000
PASS = 100

def _rows_read(plan: dict[str, Any]) -> int:
    """Every row the plan's nodes produced or filtered out, over all their loops (EXPLAIN ANALYZE)."""
    return sum(
        round((float(n.get("Actual Rows", 0)) + float(n.get("Rows Removed by Filter", 0))) * n.get("Actual Loops", 1))
        for n in plan_nodes(plan)
    )


async def test_the_queue_move_reads_its_pass_not_the_backlog_on_stale_statistics(backends: Backends) -> None:
    pool = backends.pool
    async with pool.acquire() as conn:
        backlog = await stale_backlog(conn, "CREATED", BACKLOG)  # statistics taken while no task was CREATED
        ids = backlog[10_000:10_000 + PASS]
        undone = conn.transaction()  # the move's effect is rolled back; its plan and its rows are what is checked
        await undone.start()
        [explained] = await conn.fetchval(
            f"EXPLAIN (ANALYZE, FORMAT JSON) {sql.query('submit_queue_created')}", ids, "dispatcher", "published"
        )
        await undone.rollback()
    assert explained["Plan"]["Actual Rows"] == PASS  # the pass moved, every task of it
    read = _rows_read(explained["Plan"])
    # each side of the move reads the pass's rows by primary key (100 each); on the statistics' choice of
    # task_end_user_pending_idx it read 20,000 x 20,000 (f56ad66's self-join) or 20,000 (566d138's one scan)
    assert read <= 10 * PASS, f"{read:,} rows read for a pass of {PASS}"
