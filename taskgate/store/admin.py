"""TaskAdmin's queries: stats, keyset-paged listings, the rows a requeue reads or locks, replays, dead letters."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from taskgate import sql
from taskgate.model import TaskRow
from taskgate.paging import Cursor
from taskgate.states import CallbackStatus, Status
from taskgate.store.pool import Conn
from taskgate.store.submissions import NewTask, by_column


@dataclass(frozen=True, slots=True)
class StateCount:
    """How many tasks of one model (and, in live_priority_counts, one priority) are in one state."""

    model_id: str
    status: Status
    count: int
    priority: int | None = None  # None: every priority counted together


@dataclass(frozen=True, slots=True)
class WorkerStat:
    """A registered worker, or one holding PROCESSING tasks: its load, its slots and whether it is alive."""

    worker_id: str
    running: int
    slots: int
    last_heartbeat: datetime | None
    alive: bool
    device: str = ""  # empty: a worker only its PROCESSING tasks name (no registry row)
    draining: bool = False
    control_address: str = ""  # host:port of its WorkerControl; empty until it serves (or without a registry row)
    devices: int = 0
    capacity: float = 0.0  # its share of the cluster-wide cap (devices x slots per device)


@dataclass(frozen=True, slots=True)
class CallbackCount:
    """How many webhook deliveries are in one state."""

    status: CallbackStatus
    count: int


@dataclass(frozen=True, slots=True)
class LeasedTask:
    """A task, whether it holds a live lease (PROCESSING with an unexpired lease), and the task replaying it."""

    task: TaskRow
    lease_live: bool
    replayed_as: int | None = None


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """A dead letter with its task, and the task an operator replayed it as (None: not replayed)."""

    task: TaskRow
    reason: str
    dead_at: datetime
    replayed_as: int | None = None
    replayed_at: datetime | None = None


async def task_previews(db: Conn, task_id: int) -> list[str]:
    """A task's preview images as its attempts named them, the newest last (empty: none, or no such task)."""
    return list(await db.fetchval(sql.query("admin_task_previews"), task_id) or [])


async def _state_counts(db: Conn, query: str) -> list[StateCount]:
    return [StateCount(r["model_id"], Status(r["status"]), r["n"]) for r in await db.fetch(sql.query(query))]


async def state_counts(db: Conn) -> list[StateCount]:
    """Tasks per model and state."""
    return await _state_counts(db, "admin_state_counts")


async def live_counts(db: Conn) -> list[StateCount]:
    """Unfinished tasks per model and state."""
    return await _state_counts(db, "admin_live_counts")


async def live_priority_counts(db: Conn) -> list[StateCount]:
    """Unfinished tasks per model, priority and state: the queue depth by priority."""
    return [
        StateCount(r["model_id"], Status(r["status"]), r["n"], r["priority"])
        for r in await db.fetch(sql.query("admin_live_priority_counts"))
    ]


async def oldest_queued_age(db: Conn) -> float | None:
    """Seconds since the oldest QUEUED task was queued; None when none is."""
    return await db.fetchval(sql.query("admin_oldest_queued_age"))


async def worker_stats(db: Conn, *, lease_seconds: float) -> list[WorkerStat]:
    """Each registered worker and each worker holding PROCESSING tasks, by id; alive = heartbeat within the lease."""
    return [
        WorkerStat(
            r["worker_id"], r["running"], r["slots"], r["last_heartbeat"], r["alive"], r["device"], r["draining"],
            r["control_address"], r["devices"], r["capacity"],
        )
        for r in await db.fetch(sql.query("admin_worker_stats"), lease_seconds)
    ]


async def callback_counts(db: Conn) -> list[CallbackCount]:
    """Webhook deliveries per state."""
    return [
        CallbackCount(CallbackStatus(r["status"]), r["n"]) for r in await db.fetch(sql.query("admin_callback_counts"))
    ]


async def list_tasks(
    db: Conn,
    *,
    statuses: Sequence[Status],
    model_id: str | None,
    older_than_seconds: float | None,
    after: Cursor | None,
    limit: int,
    newest_first: bool = False,
) -> list[TaskRow]:
    """Tasks by state (none: all), model and time since their last update, least recently updated first (or, with
    `newest_first`, most recently: the latest failures without walking every older one).

    Keyset-paged on (updated_at, id): `after` holds the last row's updated_at and id.
    """
    if newest_first:  # its query descends the (status, updated_at) index once per state, so it names each one
        wanted = list(dict.fromkeys(statuses)) or list(Status)
        states = [s.value for s in wanted]
    else:
        states = [s.value for s in statuses]
    rows = await db.fetch(
        *sql.bind(
            "admin_list_tasks_newest" if newest_first else "admin_list_tasks",
            states=states,
            model_id=model_id,
            older_than_seconds=older_than_seconds,
            after_at=after.at if after else None,
            after_id=after.task_id if after else None,
            limit=limit,
        )
    )
    return [TaskRow.from_record(r) for r in rows]


async def requeue_page(
    db: Conn,
    *,
    statuses: Sequence[Status],
    model_id: str | None,
    older_than_seconds: float | None,
    after_id: int,
    limit: int,
) -> list[int]:
    """Ids of tasks in `statuses` matching a requeue filter, by id after `after_id` (stable while they are requeued)."""
    rows = await db.fetch(
        *sql.bind(
            "admin_requeue_page",
            statuses=[s.value for s in statuses],
            model_id=model_id,
            older_than_seconds=older_than_seconds,
            after_id=after_id,
            limit=limit,
        )
    )
    return [r["id"] for r in rows]


async def _leased(db: Conn, query: str, task_ids: Sequence[int]) -> dict[int, LeasedTask]:
    return {
        r["id"]: LeasedTask(TaskRow.from_record(r), r["lease_live"], r["replayed_as"])
        for r in await db.fetch(sql.query(query), list(task_ids))
    }


async def peek_tasks(db: Conn, task_ids: Sequence[int]) -> dict[int, LeasedTask]:
    """The tasks that exist among `task_ids`, by id, read without locking."""
    return await _leased(db, "admin_peek_tasks", task_ids)


async def lock_tasks(db: Conn, task_ids: Sequence[int]) -> dict[int, LeasedTask]:
    """The tasks among `task_ids` locked for a requeue, by id; rows a scan or a worker holds are left out.

    Run it inside the caller's transaction: the locks last until it ends.
    """
    return await _leased(db, "admin_lock_tasks", task_ids)


async def replay_tasks(db: Conn, replays: Sequence[tuple[NewTask, int]]) -> list[TaskRow]:
    """Inserts each new task (CREATED, no limits) as the replay of its source id and links the source's dead letter
    to it; returns the tasks inserted, by id (an item whose idempotency key is taken inserts nothing).

    One replay per source (a unique index): run it in the transaction that locked the sources and found none.
    """
    rows = await db.fetch(
        *sql.bind("admin_replay_tasks", **by_column([new for new, _ in replays]), replay_of=[s for _, s in replays])
    )
    return [TaskRow.from_record(r) for r in rows]


@dataclass(frozen=True, slots=True)
class WebhookRecord:
    """A webhook delivery as operators list it: where it goes, how far it got and why it failed last."""

    id: int
    task_id: int
    user_id: str
    webhook_id: str
    event_type: str
    url: str
    status: CallbackStatus
    attempts: int
    last_status_code: int | None
    last_error: str | None
    created_at: datetime
    next_attempt_at: datetime
    last_attempt_at: datetime | None


async def deliveries(
    db: Conn, *, status: CallbackStatus | None, before: Cursor | None, limit: int
) -> list[WebhookRecord]:
    """Webhook deliveries in `status` (None: all), newest first; keyset-paged on (created_at, id) by `before`."""
    rows = await db.fetch(
        sql.query("admin_deliveries"), status.value if status else None, before.at if before else None,
        before.task_id if before else None, limit,
    )
    return [
        WebhookRecord(
            r["id"],
            r["task_id"],
            r["user_id"],
            r["webhook_id"],
            r["event_type"],
            r["url"],
            CallbackStatus(r["status"]),
            r["attempts"],
            r["last_status_code"],
            r["last_error"],
            r["created_at"],
            r["next_attempt_at"],
            r["last_attempt_at"],
        )
        for r in rows
    ]


async def dead_letters(db: Conn, *, before: Cursor | None, limit: int) -> list[DeadLetter]:
    """Dead letters with their tasks, newest first.

    Keyset-paged on (dead_at, task id): `before` holds the last row's dead_at and task id.
    """
    rows = await db.fetch(
        sql.query("admin_dead_letters"), before.at if before else None, before.task_id if before else None, limit
    )
    return [
        DeadLetter(TaskRow.from_record(r), r["dead_reason"], r["dead_at"], r["replayed_as"], r["replayed_at"])
        for r in rows
    ]
