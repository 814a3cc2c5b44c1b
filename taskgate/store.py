"""Every database operation on tasks: the connection pool and the guarded transitions."""

from __future__ import annotations

import enum
import json
import logging
from dataclasses import dataclass
from typing import Any, TypeAlias

import asyncpg

from taskgate import sql, states, telemetry
from taskgate.model import TaskRow
from taskgate.states import Status

log = logging.getLogger("taskgate.transition")

Conn: TypeAlias = "asyncpg.Connection[Any] | asyncpg.Pool[Any]"


class Move(enum.Enum):
    """A named transition: the query block that performs it, its target, and the states it leaves."""

    QUEUE = ("queue_task", Status.QUEUED, (Status.CREATED,))
    REPUBLISH = ("republish_task", Status.QUEUED, (Status.QUEUED,))
    CLAIM = ("claim_task", Status.PROCESSING, (Status.CREATED, Status.QUEUED, Status.PROCESSING))
    PROGRESS = ("progress_task", Status.PROCESSING, (Status.PROCESSING,))
    SUCCEED = ("succeed_task", Status.SUCCEEDED, (Status.PROCESSING,))
    FAIL = ("fail_task", Status.FAILED, (Status.PROCESSING,))
    RETRY = ("retry_task", Status.QUEUED, (Status.PROCESSING,))
    RELEASE = ("release_task", Status.QUEUED, (Status.PROCESSING,))
    CANCEL = ("cancel_task", Status.CANCELED, (Status.CREATED, Status.QUEUED, Status.PROCESSING))
    TIMEOUT = ("timeout_task", Status.TIMEOUT, (Status.QUEUED, Status.PROCESSING))

    def __init__(self, query: str, target: Status, sources: tuple[Status, ...]) -> None:
        self.query = query
        self.target = target
        self.sources = sources
        for src in sources:
            assert states.is_legal(src, target), f"{self.name}: {src}->{target} is not in the state table"


class Rejection(enum.Enum):
    """Why a guarded transition matched no row."""

    NOT_FOUND = "not_found"  # no such task
    ILLEGAL = "illegal"  # the task is in a state this move does not leave (or, for a claim, its lease is live)
    STALE = "stale"  # the state was right but the version or attempt was not


@dataclass(frozen=True, slots=True)
class Outcome:
    """The result of a guarded transition: the new row when applied, else why not and the current row."""

    task: TaskRow | None
    rejection: Rejection | None = None
    from_status: Status | None = None

    @property
    def applied(self) -> bool:
        return self.rejection is None


async def _init_connection(conn: asyncpg.Connection) -> None:
    for typ in ("jsonb", "json"):
        await conn.set_type_codec(typ, encoder=json.dumps, decoder=json.loads, schema="pg_catalog")


async def _keep_session(conn: asyncpg.Connection) -> None:
    """A release that sends nothing: asyncpg's default reset query costs a round trip per checkout."""


async def create_pool(dsn: str, size: int = 10) -> asyncpg.Pool:
    """A pool whose connections decode json/jsonb to Python objects."""
    # no reset query on release: no caller leaves session state (settings via server_settings, LISTEN on its own conn)
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=size, init=_init_connection, reset=_keep_session)
    assert pool is not None
    return pool




async def transition(
    db: Conn,
    task_id: int,
    move: Move,
    *args: Any,
    actor: str,
    reason: str | None = None,
    expected_version: int | None = None,
    expected_attempt: int | None = None,
    sources: tuple[Status, ...] | None = None,
) -> Outcome:
    """Runs one guarded UPDATE; logs one line when it applies; says why when it does not."""
    allowed = sources if sources is not None else move.sources
    assert set(allowed) <= set(move.sources), f"{move.name} cannot leave {allowed}"
    rec = await db.fetchrow(
        sql.query(move.query),
        task_id,
        [s.value for s in allowed],
        expected_version,
        expected_attempt,
        actor,
        reason,
        *args,
    )
    if rec is not None:
        task = TaskRow.from_record(rec)
        old = Status(rec["old_status"])
        log.info(
            "transition",
            extra={
                "task_id": str(task.id),
                "from": old.value,
                "to": task.status.value,
                "state": task.status.value,
                "version": task.version,
                "attempt": task.attempt,
                "worker": task.worker_id,
                "actor": actor,
                "reason": reason,
            },
        )
        if task.status.terminal:
            _count_finished(task)
        return Outcome(task=task, from_status=old)
    current = await get_task(db, task_id)
    if current is None:
        return Outcome(task=None, rejection=Rejection.NOT_FOUND)
    if current.status not in allowed:
        return Outcome(task=current, rejection=Rejection.ILLEGAL)
    if move is Move.CLAIM and current.status is Status.PROCESSING and expected_attempt is None:
        return Outcome(task=current, rejection=Rejection.ILLEGAL)  # lease still live
    return Outcome(task=current, rejection=Rejection.STALE)


def _count_finished(task: TaskRow) -> None:
    """Every terminal move passes here, whichever service makes it, so the counters miss none."""
    telemetry.TASKS_FINISHED.labels(task.model_id, task.task_type, task.status.value).inc()
    if task.finished_at is not None:
        telemetry.END_TO_END.labels(task.model_id).observe(max(0.0, (task.finished_at - task.created_at).total_seconds()))


async def get_task(db: Conn, task_id: int) -> TaskRow | None:
    rec = await db.fetchrow(sql.query("get_task"), task_id)
    return TaskRow.from_record(rec) if rec is not None else None


async def renew_lease(db: Conn, task_id: int, attempt: int, lease_seconds: float) -> bool:
    """Extends a running attempt's lease; False when the attempt no longer holds the task."""
    return await db.fetchval(sql.query("renew_lease"), task_id, attempt, lease_seconds) is not None


async def fail_for_good(
    pool: asyncpg.Pool[Any],
    task_id: int,
    *,
    error_code: str,
    error_msg: str,
    reason: str,
    actor: str,
    expected_attempt: int | None = None,
    move: Move = Move.FAIL,
) -> Outcome:
    """FAILED (or TIMEOUT with move=Move.TIMEOUT) and a dead_letter row, in one transaction."""
    async with pool.acquire() as conn, conn.transaction():
        out = await transition(
            conn, task_id, move, error_code, error_msg, actor=actor, reason=reason, expected_attempt=expected_attempt
        )
        if out.applied:
            await conn.execute(sql.query("insert_dead_letter"), task_id, reason, error_code, error_msg)
        return out
