"""The scheduler's scans: each finds one kind of stuck task in a bounded, locked batch and moves it on.

Every scan runs in one transaction: select due rows with FOR UPDATE SKIP LOCKED (so two replicas never take the
same row), publish what must be published, then move each row with store.transition guarded by its version.
A row whose publish failed is left as it was; the next pass tries it again.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, ClassVar, Protocol

import asyncpg
from nats.errors import Error as NatsError

from taskgate import bus as busmod
from taskgate import sql, store, telemetry
from taskgate.config import Settings
from taskgate.model import TaskRow
from taskgate.store import Move
from taskgate.v1 import task_pb2

log = logging.getLogger("taskgate.scheduler")

ACTOR = "scheduler"
QUEUE_TIMEOUT = "QUEUE_TIMEOUT"
PROCESSING_TIMEOUT = "PROCESSING_TIMEOUT"


class Action(enum.StrEnum):
    """What a scan did to a task; the label of SCHEDULER_ACTIONS."""

    QUEUE = "queue"  # CREATED -> QUEUED after re-publishing a lost dispatch
    REPUBLISH = "republish"  # QUEUED -> QUEUED with a new dispatch
    QUEUE_TIMEOUT = "queue_timeout"  # QUEUED -> TIMEOUT after max_republish re-publishes
    RELEASE = "release"  # PROCESSING with an expired lease -> QUEUED
    GRACE = "grace"  # one extension of a slow but live attempt
    PROCESSING_TIMEOUT = "processing_timeout"  # PROCESSING -> TIMEOUT after the grace
    DEAD_LETTER = "dead_letter"  # a missing dead_letter row written
    FORGET_WORKER = "forget_worker"  # a silent worker's registry row deleted
    REQUEUE = "requeue"  # an operator's RequeueTasks moved a task


@dataclass(frozen=True)
class ScanContext:
    """What every scan needs: settings, the pool and the bus."""

    settings: Settings
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


def dispatch_msg_id(task: TaskRow, move: Move) -> str:
    """The Nats-Msg-Id of the dispatch that goes with a move back to QUEUED (see the cross-service contract)."""
    if move is Move.QUEUE:
        return f"{task.id}.q0"
    if move is Move.REPUBLISH:
        # the version after the bump never repeats (publish_count restarts after a release)
        return f"{task.id}.p{task.version + 1}"
    if move is Move.RELEASE:
        return f"{task.id}.a{task.attempt}"
    raise ValueError(f"{move.name} publishes no dispatch")


async def publish_dispatch(bus: busmod.Bus, task: TaskRow, msg_id: str) -> None:
    """Publishes the dispatch hint of a task and waits for JetStream's ack."""
    payload = task_pb2.TaskDispatch(
        task_id=str(task.id),
        model_id=task.model_id,
        priority=task.priority,  # type: ignore[arg-type]
        published_at_unix_ms=int(time.time() * 1000),
    ).SerializeToString()
    await bus.js.publish(busmod.task_subject(task.model_id, task.priority), payload, headers={"Nats-Msg-Id": msg_id})


async def publish_dispatches(bus: busmod.Bus, items: list[tuple[TaskRow, Move]]) -> list[tuple[TaskRow, Move]]:
    """Publishes concurrently; returns the items whose publish was acknowledged."""
    results = await asyncio.gather(
        *(publish_dispatch(bus, task, dispatch_msg_id(task, move)) for task, move in items), return_exceptions=True
    )
    done = []
    for (task, move), result in zip(items, results, strict=True):
        if isinstance(result, BaseException):
            log.warning("dispatch publish failed", extra={"task_id": str(task.id), "error": type(result).__name__})
        else:
            done.append((task, move))
    return done


async def time_out(conn: asyncpg.Connection, task: TaskRow, error_code: str, error_msg: str, reason: str) -> bool:
    """TIMEOUT plus a dead letter, as store.fail_for_good does, inside the caller's transaction."""
    out = await store.transition(
        conn, task.id, Move.TIMEOUT, error_code, error_msg, actor=ACTOR, reason=reason, expected_version=task.version
    )
    if out.applied:
        await conn.execute(sql.query("insert_dead_letter"), task.id, reason, error_code, error_msg)
    return out.applied


def _per_model(settings: Settings, timeout_for: Callable[[str], float]) -> tuple[list[str], list[float]]:
    models = sorted(settings.models)
    return models, [timeout_for(m) for m in models]


async def _fetch_tasks(conn: asyncpg.Connection, query: str, *args: Any) -> list[TaskRow]:
    return [TaskRow.from_record(r) for r in await conn.fetch(sql.query(query), *args)]


async def _move_published(conn: asyncpg.Connection, items: list[tuple[TaskRow, Move]], reason: str) -> Counter[Move]:
    moved: Counter[Move] = Counter()
    for task, move in items:
        out = await store.transition(conn, task.id, move, actor=ACTOR, reason=reason, expected_version=task.version)
        if out.applied:
            moved[move] += 1
    return moved


class CreatedScan:
    """CREATED longer than created_timeout_seconds: publish the dispatch (it may have been lost), then QUEUED."""

    name: ClassVar[str] = "created"
    stuck_reason: ClassVar[str] = "CREATED_TOO_LONG"

    def __init__(self, ctx: ScanContext) -> None:
        self.ctx = ctx

    async def due(self, conn: asyncpg.Connection, now: datetime | None, limit: int) -> list[TaskRow]:
        """CREATED tasks past the created timeout, locked."""
        return await _fetch_tasks(conn, "sched_created_due", now, self.ctx.settings.created_timeout_seconds, limit)

    async def run(self, now: datetime | None = None) -> ScanResult:
        async with self.ctx.pool.acquire() as conn, conn.transaction():
            tasks = await self.due(conn, now, self.ctx.settings.scan_batch_size)
            published = await publish_dispatches(self.ctx.bus, [(t, Move.QUEUE) for t in tasks])
            moved = await _move_published(conn, published, "created too long: dispatch re-published")
        return ScanResult(Counter({Action.QUEUE: moved[Move.QUEUE]}), len(tasks))


class QueuedScan:
    """QUEUED longer than the model's queue timeout: re-publish up to max_republish times, then QUEUE_TIMEOUT."""

    name: ClassVar[str] = "queued"
    stuck_reason: ClassVar[str] = "QUEUED_TOO_LONG"

    def __init__(self, ctx: ScanContext) -> None:
        self.ctx = ctx

    async def due(self, conn: asyncpg.Connection, now: datetime | None, limit: int) -> list[TaskRow]:
        """QUEUED tasks past their model's queue timeout, locked."""
        s = self.ctx.settings
        models, timeouts = _per_model(s, s.queue_timeout_for)
        smallest = min([s.queue_timeout_seconds, *timeouts])
        return await _fetch_tasks(conn, "sched_queued_due", now, models, timeouts, s.queue_timeout_seconds, smallest, limit)

    async def run(self, now: datetime | None = None) -> ScanResult:
        s = self.ctx.settings
        result = ScanResult()
        async with self.ctx.pool.acquire() as conn, conn.transaction():
            tasks = await self.due(conn, now, s.scan_batch_size)
            result.examined = len(tasks)
            again = [(t, Move.REPUBLISH) for t in tasks if t.publish_count < s.max_republish]
            published = await publish_dispatches(self.ctx.bus, again)
            moved = await _move_published(conn, published, "queued too long: dispatch re-published")
            result.actions[Action.REPUBLISH] = moved[Move.REPUBLISH]
            for task in tasks:
                if task.publish_count >= s.max_republish:
                    msg = f"no worker took the task within the queue timeout after {task.publish_count} re-publishes"
                    if await time_out(conn, task, QUEUE_TIMEOUT, msg, "queue timeout"):
                        result.actions[Action.QUEUE_TIMEOUT] += 1
        return result


class LeaseScan:
    """PROCESSING with an expired lease (the worker is gone): back to QUEUED with a new dispatch.

    The next claim increments the attempt, so the old attempt's writes (guarded by expected_attempt) are refused.
    """

    name: ClassVar[str] = "lease"
    stuck_reason: ClassVar[str] = "LEASE_EXPIRED"

    def __init__(self, ctx: ScanContext) -> None:
        self.ctx = ctx

    async def due(self, conn: asyncpg.Connection, now: datetime | None, limit: int) -> list[TaskRow]:
        """PROCESSING tasks whose lease expired, locked."""
        return await _fetch_tasks(conn, "sched_lease_expired", now, limit)

    async def run(self, now: datetime | None = None) -> ScanResult:
        async with self.ctx.pool.acquire() as conn, conn.transaction():
            tasks = await self.due(conn, now, self.ctx.settings.scan_batch_size)
            published = await publish_dispatches(self.ctx.bus, [(t, Move.RELEASE) for t in tasks])
            moved = await _move_published(conn, published, "lease expired: worker lost")
        return ScanResult(Counter({Action.RELEASE: moved[Move.RELEASE]}), len(tasks))


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
        models, timeouts = _per_model(s, s.processing_timeout_for)
        return await _fetch_tasks(
            conn, "sched_processing_overdue", now, models, timeouts, s.processing_timeout_seconds,
            s.processing_grace_seconds, limit,
        )

    async def run(self, now: datetime | None = None) -> ScanResult:
        result = ScanResult()
        timed_out: list[TaskRow] = []
        async with self.ctx.pool.acquire() as conn, conn.transaction():
            tasks = await self.due(conn, now, self.ctx.settings.scan_batch_size)
            result.examined = len(tasks)
            for task in tasks:
                if not task.timeout_extended:
                    if await conn.fetchval(sql.query("sched_grant_grace"), task.id, task.attempt) is not None:
                        log.info("processing grace granted", extra={"task_id": str(task.id), "worker": task.worker_id})
                        result.actions[Action.GRACE] += 1
                elif await time_out(conn, task, PROCESSING_TIMEOUT, "the task ran past its processing timeout", "processing timeout"):
                    timed_out.append(task)
        result.actions[Action.PROCESSING_TIMEOUT] = len(timed_out)
        try:
            for task in timed_out:
                signal = task_pb2.CancelSignal(task_id=str(task.id), hard=True, reason=PROCESSING_TIMEOUT)
                await self.ctx.bus.nc.publish(busmod.CANCEL_SUBJECT, signal.SerializeToString())
            if timed_out:
                await self.ctx.bus.nc.flush()
        except (NatsError, OSError, TimeoutError) as exc:  # only a hint: the worker's next lease renewal fails too
            log.warning("cancel signal not sent", extra={"error": type(exc).__name__})
        return result


class DeadLetterScan:
    """FAILED tasks that exhausted their retries but have no dead_letter row get one (a safety net)."""

    name: ClassVar[str] = "dead_letter"

    def __init__(self, ctx: ScanContext) -> None:
        self.ctx = ctx

    async def run(self, now: datetime | None = None) -> ScanResult:
        s = self.ctx.settings
        rows = await self.ctx.pool.fetch(
            sql.query("sched_dead_letter_missing"), now, s.dead_letter_window_seconds, "retries exhausted", s.scan_batch_size
        )
        return ScanResult(Counter({Action.DEAD_LETTER: len(rows)}), len(rows))


class WorkerScan:
    """Deletes registry rows of workers silent for worker_forget_seconds."""

    name: ClassVar[str] = "workers"

    def __init__(self, ctx: ScanContext) -> None:
        self.ctx = ctx

    async def run(self, now: datetime | None = None) -> ScanResult:
        s = self.ctx.settings
        rows = await self.ctx.pool.fetch(sql.query("sched_forget_workers"), now, s.worker_forget_seconds, s.scan_batch_size)
        for row in rows:
            log.info("worker forgotten", extra={"worker": row["id"]})
        return ScanResult(Counter({Action.FORGET_WORKER: len(rows)}), len(rows))


def count(result: ScanResult) -> None:
    """Adds a scan's actions to SCHEDULER_ACTIONS."""
    for action, n in result.actions.items():
        if n:
            telemetry.SCHEDULER_ACTIONS.labels(action.value).inc(n)
