"""The task state machine's moves: one guarded UPDATE each, typed, logged once when applied.

Each move is a small frozen dataclass (its own parameters) run by `apply`; the named functions below are what
services call. The SQL is the `*_task` blocks of sql/queries/tasks.sql; the history trigger records every move.
The claim (-> PROCESSING as a new attempt) is not among them: it is the worker's one statement, store.workers.claim_for
(functions/worker_claim.sql).
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypedDict

import asyncpg

from taskgate import sql, states, telemetry
from taskgate.model import TaskRow
from taskgate.states import Status
from taskgate.store.pool import Conn

log = logging.getLogger("taskgate.transition")


class Move(enum.Enum):
    """A named transition: the query block that performs it, its target, and the states it leaves."""

    QUEUE = ("queue_task", Status.QUEUED, (Status.CREATED,))
    REPUBLISH = ("republish_task", Status.QUEUED, (Status.QUEUED,))
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
    ILLEGAL = "illegal"  # the task is in a state this move does not leave
    STALE = "stale"  # the state was right but the version or attempt was not


class CancelMode(enum.StrEnum):
    """Soft lets a running attempt finish (its output kept for reuse); hard stops it now."""

    SOFT = "soft"
    HARD = "hard"


@dataclass(frozen=True, slots=True)
class Outcome:
    """The result of a guarded transition: the new row when applied, else why not and the current row."""

    task: TaskRow | None
    rejection: Rejection | None = None
    from_status: Status | None = None

    @property
    def applied(self) -> bool:
        return self.rejection is None


@dataclass(frozen=True, slots=True)
class ResultRef:
    """A stored output as a task records it."""

    uri: str
    content_type: str
    size: int
    sha256: str
    reused: bool = False


@dataclass(frozen=True, slots=True)
class TextOutcome:
    """A chat task's answer as its row records it: the text's beginning (`text`, up to the inline size), the whole
    answer's length, why generation ended, and the tokens of its input and its output."""

    text: str
    chars: int
    finish_reason: str
    input_tokens: int
    output_tokens: int


@dataclass(frozen=True, slots=True)
class TaskError:
    """Why an attempt failed: a stable code and a human message."""

    code: str
    message: str


class Guard(TypedDict):
    """The parameters every move's block takes first (sql/queries/tasks.sql): which task, the states it may leave,
    the version and attempt it must still have (None: any), and who moves it and why."""

    task_id: int
    sources: list[str]
    expected_version: int | None
    expected_attempt: int | None
    actor: str
    reason: str | None


class Seconds(TypedDict):
    """An attempt's measured seconds as the blocks that add them take them (Metered.seconds())."""

    device_seconds: float
    slot_seconds: float
    wasted_seconds: float


# ---- the moves: each knows its Move and binds its own block (the guard, then its own parameters by name) ----


@dataclass(frozen=True, slots=True)
class Queue:
    """CREATED -> QUEUED once the dispatch message is on JetStream."""

    move: ClassVar[Move] = Move.QUEUE

    def bind(self, guard: Guard) -> tuple[Any, ...]:
        return sql.bind("queue_task", **guard)


@dataclass(frozen=True, slots=True)
class Republish:
    """QUEUED -> QUEUED: the dispatch message was sent again."""

    move: ClassVar[Move] = Move.REPUBLISH

    def bind(self, guard: Guard) -> tuple[Any, ...]:
        return sql.bind("republish_task", **guard)


@dataclass(frozen=True, slots=True)
class Progress:
    """PROCESSING -> PROCESSING with new progress; renews the lease."""

    percent: int
    lease_seconds: float
    move: ClassVar[Move] = Move.PROGRESS

    def bind(self, guard: Guard) -> tuple[Any, ...]:
        return sql.bind("progress_task", **guard, percent=self.percent, lease_seconds=self.lease_seconds)


@dataclass(frozen=True, slots=True)
class Metered:
    """An attempt's measured seconds: holding its device (the model's device phase) for steps that counted, holding its
    slot, and holding its device for steps a later attempt computes again (after its newest checkpoint)."""

    device_seconds: float = 0.0
    slot_seconds: float = 0.0
    wasted_seconds: float = 0.0

    def seconds(self) -> Seconds:
        return Seconds(
            device_seconds=max(self.device_seconds, 0.0),
            slot_seconds=max(self.slot_seconds, 0.0),
            wasted_seconds=max(self.wasted_seconds, 0.0),
        )


UNMETERED = Metered()  # a move made by anyone but the attempt's own worker: no seconds of its own to add


@dataclass(frozen=True, slots=True)
class Succeed:
    """PROCESSING -> SUCCEEDED with its result and the attempt's measured seconds."""

    result: ResultRef
    metered: Metered = UNMETERED
    text: TextOutcome | None = None  # a chat task's answer and tokens
    move: ClassVar[Move] = Move.SUCCEED

    def bind(self, guard: Guard) -> tuple[Any, ...]:
        r, t = self.result, self.text
        return sql.bind(
            "succeed_task",
            **guard,
            uri=r.uri,
            content_type=r.content_type,
            size=r.size,
            sha256=r.sha256,
            reused=r.reused,
            **self.metered.seconds(),
            text=t.text if t else None,
            chars=t.chars if t else None,
            finish_reason=t.finish_reason if t else None,
            input_tokens=t.input_tokens if t else None,
            output_tokens=t.output_tokens if t else None,
        )


@dataclass(frozen=True, slots=True)
class Fail:
    """PROCESSING -> FAILED; `worker_lost` counts the attempt as a lost worker's."""

    error: TaskError
    worker_lost: bool = False
    metered: Metered = UNMETERED
    move: ClassVar[Move] = Move.FAIL

    def bind(self, guard: Guard) -> tuple[Any, ...]:
        return sql.bind(
            "fail_task",
            **guard,
            error_code=self.error.code,
            error_message=self.error.message,
            worker_lost=self.worker_lost,
            **self.metered.seconds(),
        )


@dataclass(frozen=True, slots=True)
class Retry:
    """PROCESSING -> QUEUED after a retryable failure, not claimable for `delay_seconds`."""

    error: TaskError
    delay_seconds: float
    metered: Metered = UNMETERED
    move: ClassVar[Move] = Move.RETRY

    def bind(self, guard: Guard) -> tuple[Any, ...]:
        return sql.bind(
            "retry_task",
            **guard,
            error_code=self.error.code,
            error_message=self.error.message,
            delay_seconds=self.delay_seconds,
            **self.metered.seconds(),
        )


@dataclass(frozen=True, slots=True)
class Release:
    """PROCESSING -> QUEUED without spending a retry (a lost or drained worker, an operator's requeue).

    `worker_lost`: the attempt's worker was lost (the task runs alone from then on); counted toward
    max_worker_losses unless `in_company` (the worker held other tasks too: counted in company_losses).
    """

    worker_lost: bool = False
    metered: Metered = UNMETERED
    keep_order: bool = False  # a preempted task keeps its place in its level's queue
    in_company: bool = False
    move: ClassVar[Move] = Move.RELEASE

    def bind(self, guard: Guard) -> tuple[Any, ...]:
        return sql.bind(
            "release_task",
            **guard,
            worker_lost=self.worker_lost,
            **self.metered.seconds(),
            keep_order=self.keep_order,
            in_company=self.in_company,
        )


@dataclass(frozen=True, slots=True)
class Cancel:
    """CREATED/QUEUED/PROCESSING -> CANCELED."""

    mode: CancelMode
    move: ClassVar[Move] = Move.CANCEL

    def bind(self, guard: Guard) -> tuple[Any, ...]:
        return sql.bind("cancel_task", **guard, mode=self.mode.value)


@dataclass(frozen=True, slots=True)
class TimeOut:
    """QUEUED/PROCESSING -> TIMEOUT."""

    error: TaskError
    move: ClassVar[Move] = Move.TIMEOUT

    def bind(self, guard: Guard) -> tuple[Any, ...]:
        return sql.bind("timeout_task", **guard, error_code=self.error.code, error_message=self.error.message)


Change = Queue | Republish | Progress | Succeed | Fail | Retry | Release | Cancel | TimeOut


async def apply(
    db: Conn,
    task_id: int,
    change: Change,
    *,
    actor: str,
    reason: str | None = None,
    expected_version: int | None = None,
    expected_attempt: int | None = None,
    sources: tuple[Status, ...] | None = None,
) -> Outcome:
    """Runs one guarded UPDATE; logs one line when it applies; says why when it does not."""
    move = change.move
    allowed = sources if sources is not None else move.sources
    assert set(allowed) <= set(move.sources), f"{move.name} cannot leave {allowed}"
    guard = Guard(
        task_id=task_id,
        sources=[s.value for s in allowed],
        expected_version=expected_version,
        expected_attempt=expected_attempt,
        actor=actor,
        reason=reason,
    )
    rec = await db.fetchrow(*change.bind(guard))
    if rec is not None:
        task = TaskRow.from_record(rec)
        old = Status(rec["old_status"])
        applied(task, old, actor=actor, reason=reason)
        return Outcome(task=task, from_status=old)
    current = await get_task(db, task_id)
    if current is None:
        return Outcome(task=None, rejection=Rejection.NOT_FOUND)
    if current.status not in allowed:
        return Outcome(task=current, rejection=Rejection.ILLEGAL)
    return Outcome(task=current, rejection=Rejection.STALE)


def applied(task: TaskRow, old: Status, *, actor: str, reason: str | None) -> None:
    """The one log line (and, for a terminal move, the counters) of a move that applied, whichever statement made it."""
    logged(task.id, old, task.status, version=task.version, attempt=task.attempt, worker=task.worker_id, actor=actor,
           reason=reason)
    if task.status.terminal:
        _count_finished(task)


def logged(
    task_id: int, old: Status, new: Status, *, version: int, attempt: int, worker: str | None, actor: str,
    reason: str | None,
) -> None:
    """A move's log line from what it names (applied's, and a beat's progress moves, which read no whole row)."""
    log.info(
        "transition",
        extra={
            "task_id": str(task_id),
            "from": old.value,
            "to": new.value,
            "state": new.value,
            "version": version,
            "attempt": attempt,
            "worker": worker,
            "actor": actor,
            "reason": reason,
        },
    )


def _count_finished(task: TaskRow) -> None:
    """Every terminal move passes here, whichever service makes it, so the counters miss none."""
    telemetry.TASKS_FINISHED.labels(task.model_id, task.task_type, task.status.value).inc()
    if task.finished_at is not None:
        telemetry.END_TO_END.labels(task.model_id).observe(
            max(0.0, (task.finished_at - task.created_at).total_seconds())
        )


# ---- what services call ----


async def queue(
    db: Conn, task_id: int, *, actor: str, reason: str | None = None, expected_version: int | None = None
) -> Outcome:
    """CREATED -> QUEUED once the task's dispatch message is on JetStream."""
    return await apply(db, task_id, Queue(), actor=actor, reason=reason, expected_version=expected_version)


async def republish(
    db: Conn, task_id: int, *, actor: str, reason: str | None = None, expected_version: int | None = None
) -> Outcome:
    """QUEUED -> QUEUED after the dispatch message was sent again."""
    return await apply(db, task_id, Republish(), actor=actor, reason=reason, expected_version=expected_version)


async def progress(
    db: Conn,
    task_id: int,
    *,
    attempt: int,
    percent: int,
    lease_seconds: float,
    actor: str,
    reason: str | None = "progress",
) -> Outcome:
    """New progress of a running attempt (fenced by its attempt number); renews the lease."""
    return await apply(
        db, task_id, Progress(percent, lease_seconds), actor=actor, reason=reason, expected_attempt=attempt
    )


async def succeed(
    db: Conn, task_id: int, *, attempt: int, result: ResultRef, actor: str, reason: str | None = None,
    metered: Metered = UNMETERED, text: TextOutcome | None = None,
) -> Outcome:
    """PROCESSING -> SUCCEEDED with its result (and a chat task's answer), only for the attempt that still holds it."""
    return await apply(
        db, task_id, Succeed(result, metered, text), actor=actor, reason=reason, expected_attempt=attempt
    )


async def retry(
    db: Conn,
    task_id: int,
    *,
    attempt: int,
    error: TaskError,
    delay_seconds: float,
    actor: str,
    reason: str | None = None,
    metered: Metered = UNMETERED,
) -> Outcome:
    """PROCESSING -> QUEUED after a retryable failure; claimable again after `delay_seconds`."""
    return await apply(
        db, task_id, Retry(error, delay_seconds, metered), actor=actor, reason=reason, expected_attempt=attempt
    )


async def release(
    db: Conn,
    task_id: int,
    *,
    actor: str,
    reason: str | None = None,
    expected_version: int | None = None,
    expected_attempt: int | None = None,
    worker_lost: bool = False,
    metered: Metered = UNMETERED,
    keep_order: bool = False,
    in_company: bool = False,
) -> Outcome:
    """PROCESSING -> QUEUED without spending a retry; `worker_lost` counts a lost worker's attempt (in company_losses
    when `in_company`: its worker held other tasks too) and makes the task run alone from then on; `keep_order`
    leaves its place in the queue as it was (a preempted task)."""
    return await apply(
        db, task_id, Release(worker_lost, metered, keep_order, in_company), actor=actor, reason=reason,
        expected_version=expected_version,
        expected_attempt=expected_attempt,
    )


async def cancel(
    db: Conn,
    task_id: int,
    *,
    mode: CancelMode,
    actor: str,
    reason: str | None = None,
    expected_version: int | None = None,
) -> Outcome:
    """CREATED/QUEUED/PROCESSING -> CANCELED."""
    return await apply(db, task_id, Cancel(mode), actor=actor, reason=reason, expected_version=expected_version)


async def fail(
    db: Conn,
    task_id: int,
    *,
    error: TaskError,
    actor: str,
    reason: str,
    attempt: int | None = None,
    expected_version: int | None = None,
    dead_letter: bool = False,
    worker_lost: bool = False,
    metered: Metered = UNMETERED,
) -> Outcome:
    """PROCESSING -> FAILED; with `dead_letter`, a dead_letter row in the same transaction; `worker_lost` counts a lost
    worker's attempt."""
    return await _end(
        db,
        task_id,
        Fail(error, worker_lost, metered),
        actor=actor,
        reason=reason,
        attempt=attempt,
        version=expected_version,
        dead_letter=dead_letter,
    )


async def time_out(
    db: Conn,
    task_id: int,
    *,
    error: TaskError,
    actor: str,
    reason: str,
    expected_version: int | None = None,
    expected_attempt: int | None = None,
    dead_letter: bool = True,
) -> Outcome:
    """QUEUED/PROCESSING -> TIMEOUT; with `dead_letter` (the default), a dead_letter row in the same transaction."""
    return await _end(
        db, task_id, TimeOut(error), actor=actor, reason=reason, attempt=expected_attempt, version=expected_version,
        dead_letter=dead_letter,
    )


async def _end(
    db: Conn,
    task_id: int,
    change: Fail | TimeOut,
    *,
    actor: str,
    reason: str,
    attempt: int | None,
    version: int | None,
    dead_letter: bool,
) -> Outcome:
    if not dead_letter:
        return await apply(
            db, task_id, change, actor=actor, reason=reason, expected_attempt=attempt, expected_version=version
        )
    if isinstance(db, asyncpg.Pool):
        async with db.acquire() as conn:
            return await _end(
                conn, task_id, change, actor=actor, reason=reason, attempt=attempt, version=version, dead_letter=True
            )
    async with db.transaction():
        out = await apply(
            db, task_id, change, actor=actor, reason=reason, expected_attempt=attempt, expected_version=version
        )
        if out.applied:
            await db.execute(sql.query("insert_dead_letter"), task_id, reason, change.error.code, change.error.message)
        return out


async def get_task(db: Conn, task_id: int) -> TaskRow | None:
    """One task by id, or None."""
    rec = await db.fetchrow(sql.query("get_task"), task_id)
    return TaskRow.from_record(rec) if rec is not None else None


async def get_tasks(db: Conn, task_ids: Sequence[int]) -> dict[int, TaskRow]:
    """The tasks of these ids that exist, by id (one statement)."""
    rows = await db.fetch(sql.query("get_tasks"), list(task_ids))
    return {int(r["id"]): TaskRow.from_record(r) for r in rows}


async def let_go(db: Conn, task_id: int, *, attempt: int) -> bool:
    """Ends a soft-cancelled attempt's lease once its worker stopped running it (the tenant's pending slot frees);
    False when it held none."""
    return await db.fetchval(sql.query("let_go_task"), task_id, attempt) is not None

