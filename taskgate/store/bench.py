"""`make bench` only: the raw-ceiling handler's statements, closing a phase, and bulk history. No service calls
these."""

from __future__ import annotations

from taskgate import sql
from taskgate.store.pool import Conn


async def ceiling_insert(
    db: Conn, *, task_id: int, tenant: str, key: str, prompt: str, model: str, queue_name: str
) -> None:
    """The least a durable submit writes: one CREATED row."""
    await db.execute(
        *sql.bind(
            "bench_ceiling_insert",
            task_id=task_id,
            user_id=tenant,
            idempotency_key=key,
            prompt=prompt,
            model_id=model,
            queue_name=queue_name,
        )
    )


async def ceiling_queue(db: Conn, task_id: int) -> None:
    """CREATED -> QUEUED without the guarded transition's extras."""
    await db.execute(sql.query("bench_ceiling_queue"), task_id)


async def close_open(db: Conn) -> int:
    """Cancels every unfinished task; returns how many."""
    done = await db.execute(sql.query("bench_close_open"))
    return int(done.split()[-1])


async def count_by_status(db: Conn, ids: list[int]) -> dict[str, int]:
    """How many of the tasks `ids` are in each status (a task without a row counts nowhere)."""
    return {row["status"]: int(row["n"]) for row in await db.fetch(sql.query("bench_count_status"), ids)}


async def metered(db: Conn, ids: list[int]) -> tuple[float, float]:
    """The device seconds the tasks `ids` metered as counting, and as wasted."""
    row = await db.fetchrow(sql.query("bench_metered"), ids)
    return float(row["counted"]), float(row["wasted"])


async def events_unrelayed(db: Conn) -> bool:
    """Whether any event is still waiting for the relay."""
    return bool(await db.fetchval("SELECT EXISTS (SELECT 1 FROM event_outbox)"))


async def fill_history(db: Conn, *, rows: int, tenant: str, events_seconds: float, results_seconds: float) -> None:
    """`rows` finished tasks (a tenth of them `tenant`'s) and their terminal events, then a vacuum (superuser): as the
    retentions (`events_seconds`, `results_seconds`) leave them, so the scheduler has no backlog to purge meanwhile."""
    await db.execute(sql.query("bench_triggers_off"))
    try:
        await db.execute(sql.query("bench_insert_history"), rows, tenant, results_seconds, timeout=1800)
        await db.execute(sql.query("bench_insert_history_events"), rows, events_seconds, timeout=1800)
    finally:
        await db.execute(sql.query("bench_triggers_on"))
    # A table that has held a million rows for a while has been vacuumed: do it now, so autovacuum does not
    # run during the measurement instead.
    await db.execute("VACUUM (ANALYZE) task", timeout=900)
    await db.execute("VACUUM (ANALYZE) task_event", timeout=900)


async def insert_backlog(db: Conn, *, rows: int, tenant: str, after_id: int) -> None:
    """`rows` QUEUED tasks of `tenant` with ids after `after_id`: a backlog ahead of every task submitted later at
    their level (triggers off: no events, no pending counts), then an analyze."""
    await db.execute(sql.query("bench_triggers_off"))
    try:
        await db.execute(sql.query("bench_insert_backlog"), rows, tenant, after_id, timeout=900)
    finally:
        await db.execute(sql.query("bench_triggers_on"))
    await db.execute("ANALYZE task", timeout=900)


async def delete_backlog(db: Conn, *, rows: int, after_id: int) -> None:
    """Removes what insert_backlog made (those of its tasks still QUEUED), triggers off."""
    await db.execute(sql.query("bench_triggers_off"))
    try:
        await db.execute(sql.query("bench_delete_backlog"), rows, after_id, timeout=900)
    finally:
        await db.execute(sql.query("bench_triggers_on"))
