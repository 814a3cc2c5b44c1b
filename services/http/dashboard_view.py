"""What the operator dashboard (services/http/dashboard.py) shows: one round of TaskAdmin calls read into a View of
plain lines (queue depth, workers, running, waiting and recent tasks, failures, dead letters, failing webhooks) that
dashboard_page.py renders."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from google.protobuf.timestamp_pb2 import Timestamp

from taskgate_api.v1 import admin_pb2, task_pb2

# rows per section: enough for a laptop screen, bounded reads for the scheduler
RUNNING_ROWS = 50
WAITING_ROWS = 15
RECENT_ROWS = 10
FAILURE_ROWS = 10
DEAD_ROWS = 20
WEBHOOK_ROWS = 20

_TERMINAL = [
    task_pb2.TASK_STATUS_SUCCEEDED,
    task_pb2.TASK_STATUS_FAILED,
    task_pb2.TASK_STATUS_TIMEOUT,
    task_pb2.TASK_STATUS_CANCELED,
]


def _when(ts: Timestamp, present: bool) -> datetime | None:
    return ts.ToDatetime(tzinfo=UTC) if present else None


def _status(value: int) -> str:
    known = value in task_pb2.TaskStatus.values()
    return task_pb2.TaskStatus.Name(value).removeprefix("TASK_STATUS_") if known else "UNKNOWN"  # type: ignore[arg-type]


def _priority(value: int) -> str:
    known = value in task_pb2.Priority.values() and value != task_pb2.PRIORITY_UNSPECIFIED
    return task_pb2.Priority.Name(value).removeprefix("PRIORITY_") if known else "NORMAL"  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class TaskLine:
    """One task as a table row shows it."""

    id: str
    tenant: str
    model: str
    status: str
    priority: str
    prompt: str
    progress: int
    attempt: int
    worker: str
    error_code: str
    error_message: str
    replay_of: str
    updated: datetime | None
    started: datetime | None
    finished: datetime | None

    @classmethod
    def of(cls, t: task_pb2.Task) -> TaskLine:
        return cls(
            id=t.id,
            tenant=t.user_id,
            model=t.model_id,
            status=_status(t.status),
            priority=_priority(t.priority),
            prompt=t.prompt,
            progress=t.progress,
            attempt=t.attempt,
            worker=t.worker_id,
            error_code=t.error_code,
            error_message=t.error_message,
            replay_of=t.replay_of,
            updated=_when(t.updated_at, t.HasField("updated_at")),
            started=_when(t.started_at, t.HasField("started_at")),
            finished=_when(t.finished_at, t.HasField("finished_at")),
        )


@dataclass(frozen=True, slots=True)
class QueueLine:
    """Unfinished tasks of one model at one priority."""

    model: str
    priority: str
    created: int = 0
    queued: int = 0
    running: int = 0


@dataclass(frozen=True, slots=True)
class WorkerLine:
    id: str
    states: tuple[str, ...]  # alive or lost, and draining
    device: str
    running: int
    slots: int
    last_heartbeat: datetime | None
    address: str = ""  # its WorkerControl host:port, empty until it serves

    @property
    def can_drain(self) -> bool:
        return bool(self.address) and "alive" in self.states and "draining" not in self.states


@dataclass(frozen=True, slots=True)
class DeadLine:
    task: TaskLine
    reason: str
    dead_at: datetime | None
    replayed_as: str
    replayed_at: datetime | None


@dataclass(frozen=True, slots=True)
class DeliveryLine:
    id: int
    task_id: str
    status: str
    tenant: str
    event: str
    url: str
    attempts: int
    last_status_code: int
    last_error: str
    last_attempt: datetime | None


def _queue(live: list[admin_pb2.StateCount]) -> list[QueueLine]:
    """GetStats' live counts as one row per model and priority (highest priority first)."""
    rows: dict[tuple[str, int], dict[str, int]] = {}
    for c in live:
        row = rows.setdefault((c.model_id, c.priority or task_pb2.PRIORITY_NORMAL), {})
        column = {task_pb2.TASK_STATUS_CREATED: "created", task_pb2.TASK_STATUS_QUEUED: "queued"}.get(
            c.status, "running"
        )
        row[column] = row.get(column, 0) + c.count
    return [
        QueueLine(model, _priority(p), **row)
        for (model, p), row in sorted(rows.items(), key=lambda kv: (kv[0][0], -kv[0][1]))
    ]


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


@dataclass(frozen=True)
class View:
    """Everything one rendering of the dashboard shows, read in one round of TaskAdmin calls."""

    at: datetime
    running: int
    capacity: int
    oldest_queued: str
    callbacks: list[tuple[str, int]]
    queue: list[QueueLine]
    workers: list[WorkerLine]
    running_tasks: list[TaskLine]
    running_more: bool
    waiting: list[TaskLine]
    waiting_more: bool
    recent: list[TaskLine]
    failures: list[TaskLine]
    dead: list[DeadLine]
    webhooks: list[DeliveryLine]
    replays: dict[str, str] = field(default_factory=dict)  # task id -> the task it was replayed as, where known

    @property
    def waiting_total(self) -> int:
        return sum(q.created + q.queued for q in self.queue)

    @property
    def live_workers(self) -> int:
        return sum(1 for w in self.workers if "alive" in w.states)

    @property
    def dead_open(self) -> str:
        open_ = sum(1 for d in self.dead if not d.replayed_as)
        return f"{open_}+" if len(self.dead) >= DEAD_ROWS and open_ else str(open_)


async def read_view(admin: Any, metadata: list[tuple[str, str]], call_seconds: float) -> View:
    """One round of TaskAdmin calls, all at once, each with its own deadline; the first failed one raises."""

    def tasks(statuses: list[task_pb2.TaskStatus.ValueType], rows: int, *, newest: bool = False) -> Awaitable[Any]:
        request = admin_pb2.AdminListTasksRequest(
            filter=admin_pb2.TaskFilter(statuses=statuses), page_size=rows, newest_first=newest
        )
        return admin.ListTasks(request, metadata=metadata, timeout=call_seconds)

    def deliveries(status: task_pb2.CallbackStatus.ValueType) -> Awaitable[Any]:
        request = admin_pb2.ListCallbackDeliveriesRequest(status=status, page_size=WEBHOOK_ROWS)
        return admin.ListCallbackDeliveries(request, metadata=metadata, timeout=call_seconds)

    stats, running, waiting, recent, failures, dead, gave_up, retrying = await asyncio.gather(
        admin.GetStats(admin_pb2.GetStatsRequest(), metadata=metadata, timeout=call_seconds),
        tasks([task_pb2.TASK_STATUS_PROCESSING], RUNNING_ROWS),
        tasks([task_pb2.TASK_STATUS_CREATED, task_pb2.TASK_STATUS_QUEUED], WAITING_ROWS),
        tasks(_TERMINAL, RECENT_ROWS, newest=True),
        tasks([task_pb2.TASK_STATUS_FAILED, task_pb2.TASK_STATUS_TIMEOUT], FAILURE_ROWS, newest=True),
        admin.ListDeadLetters(
            admin_pb2.ListDeadLettersRequest(page_size=DEAD_ROWS), metadata=metadata, timeout=call_seconds
        ),
        deliveries(task_pb2.CALLBACK_STATUS_FAILED),
        deliveries(task_pb2.CALLBACK_STATUS_PENDING),
    )
    return _view(stats, running, waiting, recent, failures, dead, [*gave_up.deliveries, *retrying.deliveries])


def _view(
    stats: admin_pb2.GetStatsResponse,
    running: admin_pb2.AdminListTasksResponse,
    waiting: admin_pb2.AdminListTasksResponse,
    recent: admin_pb2.AdminListTasksResponse,
    failures: admin_pb2.AdminListTasksResponse,
    dead: admin_pb2.ListDeadLettersResponse,
    deliveries: list[admin_pb2.DeliveryRecord],
) -> View:
    running_tasks = sorted(
        (TaskLine.of(t) for t in running.tasks), key=lambda t: (t.worker, t.started or datetime.min.replace(tzinfo=UTC))
    )
    letters = [
        DeadLine(TaskLine.of(d.task), d.reason, _when(d.dead_at, d.HasField("dead_at")), d.replayed_as,
                 _when(d.replayed_at, d.HasField("replayed_at")))
        for d in dead.dead_letters
    ]
    shown = [*running_tasks, *map(TaskLine.of, waiting.tasks), *map(TaskLine.of, recent.tasks)]
    replays = {t.replay_of: t.id for t in shown if t.replay_of} | {
        d.task.id: d.replayed_as for d in letters if d.replayed_as
    }
    failing = [d for d in deliveries if d.status == task_pb2.CALLBACK_STATUS_FAILED or d.attempts > 0]
    failing.sort(
        key=lambda d: d.last_attempt_at.ToDatetime() if d.HasField("last_attempt_at") else datetime.min, reverse=True
    )
    return View(
        at=datetime.now(UTC),
        running=stats.running,
        capacity=stats.capacity,
        oldest_queued=_age(stats.oldest_queued_age.ToTimedelta().total_seconds())
        if stats.HasField("oldest_queued_age")
        else "—",
        callbacks=[
            (task_pb2.CallbackStatus.Name(c.status).removeprefix("CALLBACK_STATUS_"), c.count)
            for c in stats.callbacks
            if c.status in (task_pb2.CALLBACK_STATUS_PENDING, task_pb2.CALLBACK_STATUS_FAILED)
        ],
        queue=_queue(list(stats.live)),
        workers=[
            WorkerLine(
                w.worker_id,
                ("alive" if w.alive else "lost",) + (("draining",) if w.draining else ()),
                w.device,
                w.running,
                w.slots,
                _when(w.last_heartbeat, w.HasField("last_heartbeat")),
                w.address,
            )
            for w in stats.workers
        ],
        running_tasks=running_tasks,
        running_more=bool(running.next_page_token),
        waiting=[TaskLine.of(t) for t in waiting.tasks],
        waiting_more=bool(waiting.next_page_token),
        recent=[TaskLine.of(t) for t in recent.tasks],
        failures=[TaskLine.of(t) for t in failures.tasks],
        dead=letters,
        webhooks=[
            DeliveryLine(
                d.delivery_id,
                d.task_id,
                task_pb2.CallbackStatus.Name(d.status).removeprefix("CALLBACK_STATUS_"),
                d.tenant,
                d.event,
                d.url,
                d.attempts,
                d.last_status_code,
                d.last_error,
                _when(d.last_attempt_at, d.HasField("last_attempt_at")),
            )
            for d in failing[:WEBHOOK_ROWS]
        ],
        replays=replays,
    )
