"""Stale statistics over a backlog, for the plan tests of statements that name tasks by id (#38): the statistics are
taken while no task is in the backlog's state (the usual quiet moment when autoanalyze runs), then a burst in that
state arrives and is not analyzed. A statement that filters on the state's enum value may then prefer a partial index
of that state (its planner believes it empty) to the primary key, and walk the whole backlog."""

from __future__ import annotations

import asyncpg

# tasks $1..$2 of tenant-a in status $3 (PROCESSING ones with attempt 1, worker w1 and a live lease; CANCELED ones
# with what a hard cancel sets), no history rows
ROWS = """
INSERT INTO task (id, user_id, idempotency_key, request_hash, task_type, model_id, prompt, request_payload, priority,
                  queue_name, status, attempt, worker_id, lease_expires_at, started_at, queued_at, created_at,
                  updated_at, finished_at, cancel_mode)
SELECT i, 'tenant-a', 'stale-' || i, md5(i::text), 'text-to-video', 'wan-tiny', 'p',
       '{"num_frames": 9, "width": 32, "height": 32}'::jsonb, 5, 'wan-tiny.5', $3::task_status,
       CASE WHEN $3 = 'PROCESSING' THEN 1 ELSE 0 END, CASE WHEN $3 = 'PROCESSING' THEN 'w1' END,
       CASE WHEN $3 = 'PROCESSING' THEN now() + interval '1 minute' END, CASE WHEN $3 = 'PROCESSING' THEN now() END,
       CASE WHEN $3 IN ('QUEUED', 'PROCESSING') THEN now() END, now(), now(),
       CASE WHEN $3 = 'CANCELED' THEN now() END, CASE WHEN $3 = 'CANCELED' THEN 'hard' END
FROM generate_series($1::bigint, $2::bigint) AS i
"""

FIRST = 100_001  # the backlog's first id


async def stale_backlog(conn: asyncpg.Connection, state: str, backlog: int) -> list[int]:
    """Statistics without any task in `state`, then `backlog` tasks in it (ids FIRST..); their ids."""
    await conn.execute("ALTER TABLE task SET (autovacuum_enabled = false)")  # the statistics stay the old ones
    await conn.execute("ALTER TABLE task DISABLE TRIGGER task_event_on_insert")  # no history for fixture rows
    await conn.execute(ROWS, 1, 5_000, "CANCELED")
    await conn.execute("ANALYZE task")  # no task in `state`
    await conn.execute(ROWS, FIRST, FIRST + backlog - 1, state)  # a burst, not yet analyzed
    await conn.execute("ALTER TABLE task ENABLE TRIGGER task_event_on_insert")
    return list(range(FIRST, FIRST + backlog))


async def task_rows_read(conn: asyncpg.Connection) -> int:
    """Rows of task this transaction read so far: by sequential scans, by bitmap scans and fetched through each index
    (the backend's counters of the open transaction, so the statements inside a function count too)."""
    return int(
        await conn.fetchval(
            """
            SELECT pg_stat_get_xact_tuples_returned('task'::regclass)
                   + pg_stat_get_xact_tuples_fetched('task'::regclass)
                   + (SELECT coalesce(sum(pg_stat_get_xact_tuples_fetched(i.indexrelid)), 0)
                      FROM pg_index i WHERE i.indrelid = 'task'::regclass)
            """
        )
    )
