"""The worker's own rows: its registry entry, the per-model concurrency cap, and outputs kept for reuse.

The SQL is the `worker_*` blocks of sql/queries/worker.sql; the claim itself is the typed move in tasks.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import asyncpg

from taskgate import sql
from taskgate.states import Status
from taskgate.store.pool import Conn
from taskgate.store.tasks import Outcome, ResultRef, claim


@dataclass(frozen=True, slots=True)
class Registration:
    """What a worker's registry row says about it."""

    worker_id: str
    models: tuple[str, ...]
    slots: int
    running: int
    device: str
    draining: bool


@dataclass(frozen=True, slots=True)
class Preview:
    """What a worker reads before claiming: the task's model and state, and a reusable output for its request."""

    model_id: str
    status: Status
    reusable: ResultRef | None


async def register(db: Conn, worker: Registration) -> None:
    """Registers a worker or records its heartbeat."""
    await db.execute(
        sql.query("worker_upsert"),
        worker.worker_id,
        list(worker.models),
        worker.slots,
        worker.running,
        worker.device,
        worker.draining,
    )


async def unregister(db: Conn, worker_id: str) -> None:
    """Removes a worker's registry row (a clean exit)."""
    await db.execute(sql.query("worker_delete"), worker_id)


async def preview(db: Conn, task_id: int) -> Preview | None:
    """The task's model and state and a soft-cancelled run's output for the same request, or None: no such task."""
    rec = await db.fetchrow(sql.query("worker_preview"), task_id)
    if rec is None:
        return None
    reusable = None
    if rec["result_uri"] is not None:
        reusable = ResultRef(
            rec["result_uri"], rec["result_content_type"], rec["result_size"], rec["result_sha256"], reused=True
        )
    return Preview(rec["model_id"], Status(rec["status"]), reusable)


async def claim_within_cap(
    db: Conn,
    task_id: int,
    *,
    model_id: str,
    cap: int,
    worker_id: str,
    lease_seconds: float,
    actor: str,
    reason: str | None = None,
    max_worker_losses: int | None = None,
) -> Outcome | None:
    """The guarded claim (store.claim); None when `cap` (if above 0) tasks of the model already run under a live lease.

    The count and the claim share one transaction under a per-model lock, so two workers never both take the last place.
    """
    if cap <= 0:
        return await claim(
            db, task_id, worker_id=worker_id, lease_seconds=lease_seconds, actor=actor, reason=reason,
            max_worker_losses=max_worker_losses,
        )
    if isinstance(db, asyncpg.Pool):
        async with db.acquire() as conn:
            return await claim_within_cap(
                conn, task_id, model_id=model_id, cap=cap, worker_id=worker_id, lease_seconds=lease_seconds, actor=actor,
                reason=reason, max_worker_losses=max_worker_losses,
            )
    async with db.transaction():
        await db.execute(sql.query("worker_lock_model"), model_id)
        running = await db.fetchval(sql.query("worker_count_running"), model_id, task_id)
        if running >= cap:
            return None
        return await claim(
            db, task_id, worker_id=worker_id, lease_seconds=lease_seconds, actor=actor, reason=reason,
            max_worker_losses=max_worker_losses,
        )


async def keep_reusable(db: Conn, task_id: int, *, attempt: int, result: ResultRef) -> bool:
    """Keeps a soft-cancelled attempt's output for an identical request; False when the guard or the key says no."""
    kept = await db.fetchval(
        sql.query("worker_keep_reusable"), task_id, attempt, result.uri, result.content_type, result.size, result.sha256
    )
    return kept is not None
