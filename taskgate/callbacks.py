"""Callback deliveries that more than one service touches (the notifier sends them; admins replay them)."""

from __future__ import annotations

import asyncpg

from taskgate import sql


async def redeliver(
    pool: asyncpg.Pool | asyncpg.Connection, task_id: int, *, include_progress: bool = False
) -> list[asyncpg.Record]:
    """Sends a task's terminal webhook(s) again with the same webhook-id, on a fresh round of the retry schedule.

    Returns the reset deliveries (id, webhook_id, event_type, status, attempts), oldest first; empty when the task has
    none (no callback URL, not terminal yet, or no such task). Every notifier replica is woken through
    NOTIFY 'taskgate_webhook' at commit, so the first attempt goes out at once.
    """
    if isinstance(pool, asyncpg.Pool):
        async with pool.acquire() as conn:
            return await redeliver(conn, task_id, include_progress=include_progress)
    async with pool.transaction():
        rows = list(await pool.fetch(sql.query("outbox_redeliver"), task_id, include_progress))
        if rows:
            await pool.execute(sql.query("outbox_wake"), str(task_id))
    return rows
