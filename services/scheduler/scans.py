"""The scheduler's scans: each finds one kind of stuck task in a bounded, locked batch and moves it on.

Every scan runs in one transaction: select due rows with FOR UPDATE SKIP LOCKED (so two replicas never take the
same row), publish what must be published, then move each row with its store move guarded by its version.
A row whose publish failed is left as it was; the next pass tries it again. (The scan that deletes what outlived its
retention is RetentionScan, in retention.py.)
"""

from __future__ import annotations

import enum
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import ClassVar, Protocol

import asyncpg
from nats.errors import Error as NatsError

from taskgate import bus as busmod
from taskgate import store, telemetry
from taskgate.config import SchedulerSettings
from taskgate.dispatcher import dispatch_pass
from taskgate.model import TaskRow
from taskgate.store import maintenance
from taskgate.wire import cancel, dead_letter, dispatch, preempt
from taskgate.wire.dispatch import Reason

log = logging.getLogger("taskgate.scheduler")

ACTOR = "scheduler"
QUEUE_TIMEOUT = "QUEUE_TIMEOUT"
QUEUE_TTL_EXPIRED = "QUEUE_TTL_EXPIRED"  # the task's own max_queue_seconds ran out before a worker took it
PROCESSING_TIMEOUT = "PROCESSING_TIMEOUT"
WORKER_LOST = "WORKER_LOST"


class Action(enum.StrEnum):
    """What a scan did to a task; the label of SCHEDULER_ACTIONS."""

    QUEUE = "queue"  # CREATED -> QUEUED after dispatching a task nobody dispatched
    REPUBLISH = "republish"  # QUEUED -> QUEUED with a new dispatch: its level was missing messages
    STILL_QUEUED = "still_queued"  # QUEUED -> QUEUED past the queue timeout, its level's messages all there
    QUEUE_TTL = "queue_ttl"  # QUEUED -> TIMEOUT: the task's own max_queue_seconds ran out
    QUEUE_TIMEOUT = "queue_timeout"  # QUEUED -> TIMEOUT after max_republish rounds of a queue that does not move
    RELEASE = "release"  # PROCESSING with an expired lease -> QUEUED
    WORKER_LOST = "worker_lost"  # PROCESSING with an expired lease -> FAILED after max_worker_losses lost attempts
    GRACE = "grace"  # one extension of a slow but live attempt
    PROCESSING_TIMEOUT = "processing_timeout"  # PROCESSING -> TIMEOUT after the grace
    DEAD_LETTER = "dead_letter"  # a missing dead_letter row written
    FORGET_WORKER = "forget_worker"  # a silent worker's registry row deleted
    LET_GO = "let_go"  # a soft-cancelled attempt's lapsed lease ended (its pending slot freed)
    PREEMPT = "preempt"  # a lower-priority run asked to checkpoint and release for a waiting higher-priority task
    REQUEUE = "requeue"  # an operator's RequeueTasks moved a task
    REPLAY = "replay"  # an operator's RequeueTasks replayed a FAILED or TIMEOUT task as a new task
    PURGE_TASK = "purge_task"  # a finished task past its retention deleted, with its history
    PURGE_EVENT = "purge_event"  # an event (with its webhook deliveries and attempt logs) past its retention deleted
    PURGE_RESULT = "purge_result"  # a stored output deleted from the result store
    PURGE_REUSABLE = "purge_reusable"  # a reusable output past its retention forgotten
    PURGE_CHECKPOINT = "purge_checkpoint"  # an ended task's step checkpoint deleted from the result store
    PURGE_INPUT = "purge_input"  # an input image no kept task runs from, unused past its retention, forgotten


@dataclass(frozen=True)
class ScanContext:
    """What every scan needs: settings, the pool and the bus."""

    settings: SchedulerSettings
    pool: asyncpg.Pool
    bus: busmod.Bus


@dataclass
class ScanResult:
    """What one batch of one scan did: tasks per action, and how many rows it examined (a full batch means more)."""

    actions: Counter[Action] = field(default_factory=Counter)
    examined: int = 0


class Scan(Protocol):
    """One maintenance pass over one kind of row."""

    name: ClassVar[str]

    async def run(self, now: datetime | None = None) -> ScanResult: ...


class TaskScan(Scan, Protocol):
    """A scan over tasks, which can also list what it would act on (ListStuckTasks)."""

    stuck_reason: ClassVar[str]

    async def due(self, conn: asyncpg.Connection, now: datetime | None, limit: int) -> list[TaskRow]: ...


def _timeouts(settings: SchedulerSettings, timeout_for: Callable[[str], float]) -> dict[str, float]:
    return {m: timeout_for(m) for m in settings.models}


async def _announce_dead(bus: busmod.Bus, dead: list[tuple[TaskRow, store.TaskError]], *, reason: str) -> None:
    """The dead-letter stream's notices for tasks just ended for good; after the commit, so never for a rolled-back
    row."""
    for task, error in dead:
        await dead_letter.publish(bus, task, reason=reason, error_code=error.code, error_message=error.message)


class CreatedScan:
    """CREATED longer than created_timeout_seconds, so nobody dispatched it: the dispatcher's own pass, repeated."""

    name: ClassVar[str] = "created"
    stuck_reason: ClassVar[str] = "CREATED_TOO_LONG"

    def __init__(self, ctx: ScanContext) -> None:
        self.ctx = ctx

    async def due(self, conn: asyncpg.Connection, now: datetime | None, limit: int) -> list[TaskRow]:
        """CREATED tasks past the created timeout, locked."""
        return await maintenance.created_due(
            conn, now=now, timeout_seconds=self.ctx.settings.created_timeout_seconds, limit=limit
        )

    async def run(self, now: datetime | None = None) -> ScanResult:
        s = self.ctx.settings
        async with self.ctx.pool.acquire() as conn, conn.transaction():
            tasks = await self.due(conn, now, s.scan_batch_size)
            moved = await dispatch_pass(
                conn, self.ctx.bus, tasks, actor=ACTOR, reason="created too long: dispatched by the scheduler",
                ack_timeout=s.submit_publish_timeout_seconds, within=s.submit_db_timeout_seconds,
            ) if tasks else []
        return ScanResult(Counter({Action.QUEUE: len(moved)}), len(tasks))


class QueueTTLScan:
    """QUEUED past the queue TTL its submission asked for (max_queue_seconds): TIMEOUT QUEUE_TTL_EXPIRED, dead-lettered,
    whether or not the queue moves (the client said a late start is worth nothing)."""

    name: ClassVar[str] = "queue_ttl"
    stuck_reason: ClassVar[str] = "QUEUE_TTL_EXPIRED"

    def __init__(self, ctx: ScanContext) -> None:
        self.ctx = ctx

    async def due(self, conn: asyncpg.Connection, now: datetime | None, limit: int) -> list[TaskRow]:
        """QUEUED tasks past their own queue TTL, locked."""
        return await maintenance.queue_expired(conn, now=now, limit=limit)

    async def run(self, now: datetime | None = None) -> ScanResult:
        result = ScanResult()
        dead: list[tuple[TaskRow, store.TaskError]] = []
        async with self.ctx.pool.acquire() as conn, conn.transaction():
            tasks = await self.due(conn, now, self.ctx.settings.scan_batch_size)
            result.examined = len(tasks)
            for task in tasks:
                error = store.TaskError(QUEUE_TTL_EXPIRED, "no worker took the task within its max_queue_seconds")
                out = await store.time_out(
                    conn, task.id, error=error, actor=ACTOR, reason="queue TTL expired", expected_version=task.version
                )
                result.actions[Action.QUEUE_TTL] += out.applied
                if out.applied and out.task is not None:
                    dead.append((out.task, error))
        await _announce_dead(self.ctx.bus, dead, reason="queue TTL expired")
        return result


class QueuedScan:
    """QUEUED past the model's queue timeout at a model whose queue does not move (no claim within the timeout,
    nothing running): a backlog that moves is never timed out. Per level, only the messages really missing are
    re-published (the tasks that should hold one, QUEUED or leased, against what its consumer holds); every other
    such task is marked still queued. After max_republish rounds a task ends TIMEOUT QUEUE_TIMEOUT."""

    name: ClassVar[str] = "queued"
    stuck_reason: ClassVar[str] = "QUEUED_TOO_LONG"

    def __init__(self, ctx: ScanContext) -> None:
        self.ctx = ctx

    async def due(self, conn: asyncpg.Connection, now: datetime | None, limit: int) -> list[TaskRow]:
        """QUEUED tasks past their model's queue timeout at a model whose queue does not move, locked."""
        s = self.ctx.settings
        return await maintenance.queued_due(
            conn,
            now=now,
            timeouts=_timeouts(s, s.queue_timeout_for),
            default_seconds=s.queue_timeout_seconds,
            limit=limit,
        )

    async def run(self, now: datetime | None = None) -> ScanResult:
        s = self.ctx.settings
        result = ScanResult()
        dead: list[tuple[TaskRow, store.TaskError]] = []
        async with self.ctx.pool.acquire() as conn, conn.transaction():
            tasks = await self.due(conn, now, s.scan_batch_size)
            result.examined = len(tasks)
            waiting = [t for t in tasks if t.publish_count < s.max_republish]
            missing = await self._missing(conn, waiting)
            waiting = [t for t in waiting if (t.model_id, t.priority) in missing]  # the rest: the next pass
            again: list[tuple[TaskRow, Reason]] = []
            for task in waiting:
                level = (task.model_id, task.priority)
                if missing[level] > 0:
                    missing[level] -= 1
                    again.append((task, Reason.REPUBLISHED))
            sent = {task.id for task, _ in await dispatch.publish_many(self.ctx.bus, again)}
            unsent = {task.id for task, _ in again} - sent
            for task in waiting:
                if task.id in unsent:
                    continue  # its publish failed: the next pass tries again
                if task.id in sent:
                    action, why = Action.REPUBLISH, "queued too long: its level missed a message, re-published"
                else:
                    action, why = Action.STILL_QUEUED, "queued too long: its model's queue does not move"
                out = await store.republish(conn, task.id, actor=ACTOR, reason=why, expected_version=task.version)
                result.actions[action] += out.applied
            for task in tasks:
                if task.publish_count >= s.max_republish:
                    msg = f"no worker took a task of its model within the queue timeout, {task.publish_count + 1} times"
                    error = store.TaskError(QUEUE_TIMEOUT, msg)
                    out = await store.time_out(
                        conn, task.id, error=error, actor=ACTOR, reason="queue timeout", expected_version=task.version
                    )
                    result.actions[Action.QUEUE_TIMEOUT] += out.applied
                    if out.applied and out.task is not None:
                        dead.append((out.task, error))
        await _announce_dead(self.ctx.bus, dead, reason="queue timeout")
        return result

    async def _missing(self, conn: asyncpg.Connection, tasks: list[TaskRow]) -> dict[tuple[str, int], int]:
        """Per level of `tasks`: how many dispatch messages it lacks (tasks that should hold one minus those its
        consumer holds); a level whose consumer cannot be asked is left for the next pass."""
        levels = sorted({(t.model_id, t.priority) for t in tasks})
        holders = await maintenance.level_holders(conn, levels)
        missing = {}
        for model_id, priority in levels:
            try:
                held = await busmod.level_messages(self.ctx.bus, model_id, priority)
            except (NatsError, OSError, TimeoutError) as exc:
                log.warning(
                    "consumer not answering; its level waits", extra={"model": model_id, "error": type(exc).__name__}
                )
                continue
            missing[(model_id, priority)] = max(0, holders.get((model_id, priority), 0) - held)
        return missing


class LeaseScan:
    """PROCESSING with an expired lease (the worker is gone): back to QUEUED with a new dispatch, each such loss
    counted; the loss that makes max_worker_losses fails the task WORKER_LOST (dead-lettered) instead: a task that
    kills its worker is not run on every worker in turn.

    Bystanders are not blamed: a loss is alone (the worker held only this task: counted in worker_losses, toward
    max_worker_losses) or in company (it held others too, any of which may have killed it: counted in company_losses,
    never toward the cap). Either way the task runs alone from then on, so its next death is its own: a task that
    kills its worker reaches the cap after at most one death in company, and one that only shared a worker runs alone
    and finishes.

    The next claim increments the attempt, so the old attempt's writes (guarded by expected_attempt) are refused.
    """

    name: ClassVar[str] = "lease"
    stuck_reason: ClassVar[str] = "LEASE_EXPIRED"

    def __init__(self, ctx: ScanContext) -> None:
        self.ctx = ctx

    async def due(self, conn: asyncpg.Connection, now: datetime | None, limit: int) -> list[TaskRow]:
        """PROCESSING tasks whose lease expired, locked."""
        return await maintenance.lease_expired(conn, now=now, limit=limit)

    async def run(self, now: datetime | None = None) -> ScanResult:
        limit = self.ctx.settings.max_worker_losses
        result = ScanResult()
        failed: list[tuple[TaskRow, store.TaskError]] = []
        async with self.ctx.pool.acquire() as conn, conn.transaction():
            tasks = await self.due(conn, now, self.ctx.settings.scan_batch_size)
            result.examined = len(tasks)
            # judged before any of them moves: a worker's count is recorded by the first of its tasks found lost
            company = {t.id for t in tasks if await maintenance.lost_holding(conn, t.worker_id) > 1}
            again = [(t, Reason.RELEASED) for t in tasks if t.id in company or t.worker_losses + 1 < limit]
            lost = [t for t in tasks if t.id not in company and t.worker_losses + 1 >= limit]
            for task, _ in await dispatch.publish_many(self.ctx.bus, again):
                shared = task.id in company
                out = await store.release(
                    conn, task.id, actor=ACTOR, expected_version=task.version, worker_lost=True, in_company=shared,
                    reason="lease expired: worker lost, in company" if shared else "lease expired: worker lost",
                )
                result.actions[Action.RELEASE] += out.applied
            for task in lost:
                error = store.TaskError(
                    WORKER_LOST, f"its worker was lost {task.worker_losses + 1} times while it held no other task"
                )
                out = await store.fail(
                    conn, task.id, error=error, actor=ACTOR, reason="worker lost", expected_version=task.version,
                    dead_letter=True, worker_lost=True,
                )
                if out.applied and out.task is not None:
                    failed.append((out.task, error))
        result.actions[Action.WORKER_LOST] = len(failed)
        await _announce_dead(self.ctx.bus, failed, reason="worker lost")
        return result


class ProcessingTimeoutScan:
    """PROCESSING past the model's processing timeout with a live lease: one grace, then PROCESSING_TIMEOUT.

    After the timeout a hard CancelSignal tells the worker to stop; it would also learn at its next renewal.
    """

    name: ClassVar[str] = "processing"
    stuck_reason: ClassVar[str] = "PROCESSING_TOO_LONG"

    def __init__(self, ctx: ScanContext) -> None:
        self.ctx = ctx

    async def due(self, conn: asyncpg.Connection, now: datetime | None, limit: int) -> list[TaskRow]:
        """Live PROCESSING tasks past their timeout (plus the grace once granted), locked."""
        s = self.ctx.settings
        return await maintenance.processing_overdue(
            conn,
            now=now,
            timeouts=_timeouts(s, s.processing_timeout_for),
            default_seconds=s.processing_timeout_seconds,
            grace_seconds=s.processing_grace_seconds,
            limit=limit,
        )

    async def run(self, now: datetime | None = None) -> ScanResult:
        result = ScanResult()
        timed_out: list[TaskRow] = []
        dead: list[tuple[TaskRow, store.TaskError]] = []
        async with self.ctx.pool.acquire() as conn, conn.transaction():
            tasks = await self.due(conn, now, self.ctx.settings.scan_batch_size)
            result.examined = len(tasks)
            for task in tasks:
                if not task.timeout_extended:
                    if await maintenance.grant_grace(conn, task.id, attempt=task.attempt):
                        log.info("processing grace granted", extra={"task_id": str(task.id), "worker": task.worker_id})
                        result.actions[Action.GRACE] += 1
                    continue
                error = store.TaskError(PROCESSING_TIMEOUT, "the task ran past its processing timeout")
                out = await store.time_out(
                    conn, task.id, error=error, actor=ACTOR, reason="processing timeout", expected_version=task.version
                )
                if out.applied:
                    timed_out.append(task)
                    dead.append((out.task or task, error))
        result.actions[Action.PROCESSING_TIMEOUT] = len(timed_out)
        await _announce_dead(self.ctx.bus, dead, reason="processing timeout")
        # only a hint: the worker's next lease renewal fails too (cancel.send logs a refused signal)
        for task in timed_out:
            await cancel.send(
                self.ctx.bus, task.id, hard=True, reason=PROCESSING_TIMEOUT, trace_context=task.trace_context
            )
        if timed_out:
            try:
                await self.ctx.bus.nc.flush()
            except (NatsError, OSError, TimeoutError) as exc:
                log.warning("cancel signal not sent", extra={"error": type(exc).__name__})
        return result


class DeadLetterScan:
    """FAILED tasks that exhausted their retries but have no dead_letter row get one (a safety net)."""

    name: ClassVar[str] = "dead_letter"

    def __init__(self, ctx: ScanContext) -> None:
        self.ctx = ctx

    async def run(self, now: datetime | None = None) -> ScanResult:
        s = self.ctx.settings
        added = await maintenance.add_missing_dead_letters(
            self.ctx.pool, now=now, window_seconds=s.dead_letter_window_seconds, reason="retries exhausted",
            limit=s.scan_batch_size,
        )
        return ScanResult(Counter({Action.DEAD_LETTER: added}), added)


class HoldScan:
    """Soft-cancelled attempts keep their lease (and the tenant's pending slot) while their worker runs them; one whose
    lease lapsed (the worker died before letting go) loses it here."""

    name: ClassVar[str] = "holds"

    def __init__(self, ctx: ScanContext) -> None:
        self.ctx = ctx

    async def run(self, now: datetime | None = None) -> ScanResult:
        ended = await maintenance.lapsed_holds(self.ctx.pool, now=now, limit=self.ctx.settings.scan_batch_size)
        return ScanResult(Counter({Action.LET_GO: ended}), ended)


class PreemptScan:
    """Priority preemption, for the models that opt in (`preempt_after_seconds`) and take checkpoints: a task waiting
    longer than that at a higher priority makes the worker running the model's lowest-priority task with the most
    steps left checkpoint it at its next step and release it (event reason PREEMPTED); it resumes later from there.
    At most one per model per `preempt_after_seconds` (the freed slot goes to the waiting task first), never a task of
    the same or a higher priority, never one preempted within `preempt_window_seconds`."""

    name: ClassVar[str] = "preempt"

    def __init__(self, ctx: ScanContext) -> None:
        self.ctx = ctx
        self.after = {
            model: spec.preempt_after_seconds
            for model, spec in ctx.settings.models.items()
            if spec.preempt_after_seconds is not None
            and (spec.checkpoint_every_seconds > 0 or spec.checkpoint_every_steps > 0)
        }

    async def run(self, now: datetime | None = None) -> ScanResult:
        if not self.after:
            return ScanResult()
        marked = await maintenance.preempt(
            self.ctx.pool, now=now, after=self.after, window_seconds=self.ctx.settings.preempt_window_seconds
        )
        for victim in marked:
            log.info(
                "preempting",
                extra={"task_id": str(victim.task_id), "attempt": victim.attempt, "model": victim.model_id},
            )
            await preempt.send(self.ctx.bus, victim.task_id, trace_context=victim.trace_context)
        return ScanResult(Counter({Action.PREEMPT: len(marked)}), len(marked))


class WorkerScan:
    """Deletes registry rows of workers silent for worker_forget_seconds."""

    name: ClassVar[str] = "workers"

    def __init__(self, ctx: ScanContext) -> None:
        self.ctx = ctx

    async def run(self, now: datetime | None = None) -> ScanResult:
        s = self.ctx.settings
        gone = await maintenance.forget_workers(
            self.ctx.pool, now=now, silent_seconds=s.worker_forget_seconds, limit=s.scan_batch_size
        )
        for worker_id in gone:
            log.info("worker forgotten", extra={"worker": worker_id})
        return ScanResult(Counter({Action.FORGET_WORKER: len(gone)}), len(gone))


def count(result: ScanResult) -> None:
    """Adds a scan's actions to SCHEDULER_ACTIONS."""
    for action, n in result.actions.items():
        if n:
            telemetry.SCHEDULER_ACTIONS.labels(action.value).inc(n)
