"""Operator requeues: one guarded move per task back to QUEUED, with its dispatch, never one broad UPDATE."""

from __future__ import annotations

import asyncio
import enum
import logging
from dataclasses import dataclass

import asyncpg

from services.scheduler.scans import Action
from taskgate import bus as busmod
from taskgate import store, telemetry
from taskgate.model import TaskRow
from taskgate.states import Status
from taskgate.store import Move
from taskgate.store import admin as admin_store
from taskgate.wire import dispatch
from taskgate.wire.dispatch import Reason

log = logging.getLogger("taskgate.scheduler")

# The move that puts a task of each unfinished state back in the queue, and the dispatch that goes with it.
REQUEUE_MOVES: dict[Status, store.Queue | store.Republish | store.Release] = {
    Status.CREATED: store.Queue(),
    Status.QUEUED: store.Republish(),
    Status.PROCESSING: store.Release(),
}
DISPATCH_REASONS = {Move.QUEUE: Reason.SUBMITTED, Move.REPUBLISH: Reason.REPUBLISHED, Move.RELEASE: Reason.RELEASED}


class Outcome(enum.StrEnum):
    """RequeueItem.action values."""

    REQUEUED = "REQUEUED"
    WOULD_REQUEUE = "WOULD_REQUEUE"
    SKIPPED = "SKIPPED"


@dataclass(frozen=True, slots=True)
class Item:
    """What a requeue did (or would do) to one task."""

    task_id: int
    from_status: Status | None
    outcome: Outcome
    detail: str


@dataclass(frozen=True, slots=True)
class Decision:
    """The move a requeue would make on one task (None: skip it), and why."""

    task_id: int
    task: TaskRow | None
    change: store.Change | None
    detail: str


def decide(task_id: int, task: TaskRow | None, lease_live: bool) -> Decision:
    """Terminal, missing and live-leased tasks are skipped; others get their state's move back to QUEUED."""
    if task is None:
        return Decision(task_id, None, None, "no such task")
    if task.status.terminal:
        return Decision(task_id, task, None, f"{task.status.value} is terminal")
    if task.status is Status.PROCESSING and lease_live:
        return Decision(task_id, task, None, f"worker {task.worker_id} is alive and holds the lease")
    change = REQUEUE_MOVES[task.status]
    return Decision(task_id, task, change, f"{task.status.value} -> QUEUED ({change.move.name.lower()})")


def _item(d: Decision, outcome: Outcome, detail: str | None = None) -> Item:
    return Item(d.task_id, d.task.status if d.task else None, outcome, detail or d.detail)


class Requeuer:
    """Plans (dry run) or applies requeues of one batch of task ids."""

    def __init__(self, pool: asyncpg.Pool, bus: busmod.Bus) -> None:
        self.pool = pool
        self.bus = bus

    async def plan(self, ids: list[int]) -> list[Item]:
        """What apply() would do, reading without locks and changing nothing."""
        found = await admin_store.peek_tasks(self.pool, ids)
        out = []
        for task_id in ids:
            seen = found.get(task_id)
            d = decide(task_id, seen.task if seen else None, bool(seen and seen.lease_live))
            out.append(_item(d, Outcome.WOULD_REQUEUE if d.change else Outcome.SKIPPED))
        return out

    async def apply(self, ids: list[int], *, actor: str, reason: str) -> list[Item]:
        """Locks the batch, publishes each dispatch, then moves each task; a failed publish aborts the batch."""
        async with self.pool.acquire() as conn, conn.transaction():
            locked = await admin_store.lock_tasks(conn, ids)
            missing = [i for i in ids if i not in locked]
            busy = await admin_store.peek_tasks(conn, missing) if missing else {}
            decisions: list[Decision] = []
            for task_id in ids:
                if task_id in locked:
                    decisions.append(decide(task_id, locked[task_id].task, locked[task_id].lease_live))
                elif task_id in busy:
                    row = busy[task_id].task
                    decisions.append(Decision(task_id, row, None, "busy: a scan or a worker holds the row; try again"))
                else:
                    decisions.append(decide(task_id, None, False))
            results = await asyncio.gather(
                *(
                    dispatch.publish(self.bus, d.task, DISPATCH_REASONS[d.change.move])
                    for d in decisions
                    if d.task is not None and d.change is not None
                ),
                return_exceptions=True,
            )
            for result in results:
                if isinstance(result, BaseException):
                    raise result  # nothing of this batch moves; the caller stops here
            items = []
            for d in decisions:
                if d.change is None or d.task is None:
                    items.append(_item(d, Outcome.SKIPPED))
                    continue
                out = await store.apply(
                    conn, d.task_id, d.change, actor=actor, reason=reason, expected_version=d.task.version,
                    sources=(d.task.status,),
                )
                if out.applied:
                    items.append(_item(d, Outcome.REQUEUED))
                else:
                    rejection = out.rejection.value if out.rejection else "?"
                    items.append(_item(d, Outcome.SKIPPED, f"changed meanwhile ({rejection})"))
        requeued = sum(1 for i in items if i.outcome is Outcome.REQUEUED)
        if requeued:
            telemetry.SCHEDULER_ACTIONS.labels(Action.REQUEUE.value).inc(requeued)
        return items
