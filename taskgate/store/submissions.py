"""Admission of new tasks (rate slot, tenant lock, idempotent lookup, pending limit, insert) and the tenant's reads.

The task INSERT has one author, the `insert_task` SQL function (sql/functions/submit_fast_path.sql): `admit` runs it
inside `submit_fast_path`, `create` runs it alone for rows that skip the limits (tests, tools). `within`: the seconds
a statement may run before asyncpg cancels it on the server (TimeoutError).
"""

from __future__ import annotations

import enum
from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from taskgate import bus, sql
from taskgate.model import TaskRow
from taskgate.paging import Cursor
from taskgate.states import Status
from taskgate.store.pool import Conn


class Verdict(enum.StrEnum):
    """What `admit` did with a submission."""

    CREATED = "created"
    EXISTING = "existing"  # the idempotency key already names a task: nothing inserted
    RATE_LIMITED = "rate_limited"
    NO_TENANT = "no_tenant"
    TOO_MANY_PENDING = "too_many_pending"


@dataclass(frozen=True, slots=True)
class NewTask:
    """A task to insert in CREATED: exactly the columns a submission sets."""

    id: int
    user_id: str
    idempotency_key: str
    key_derived: bool
    request_hash: str
    task_type: str
    model_id: str
    prompt: str
    payload: dict[str, Any]
    metadata: dict[str, str]
    priority: int
    max_retries: int
    callback_url: str | None
    callback_events: list[str]

    def params(self) -> tuple[object, ...]:
        """The fifteen leading parameters of submit_fast_path and insert_task."""
        return (
            self.id, self.user_id, self.idempotency_key, self.key_derived, self.request_hash, self.task_type,
            self.model_id, self.prompt, self.payload, self.metadata, self.priority,
            bus.task_subject(self.model_id, self.priority), self.max_retries, self.callback_url, self.callback_events,
        )


@dataclass(frozen=True, slots=True)
class Admission:
    """The verdict, the task (created or existing), seconds until a slot frees (rate limited), the pending limit."""

    verdict: Verdict
    task: TaskRow | None
    retry_after: float | None
    pending_limit: int | None


async def admit(
    db: Conn, new: NewTask, *, per_minute: int | None, default_max_pending: int, within: float | None = None
) -> Admission:
    """Admits one submission in one round trip; `per_minute` None when its rate slot was already taken."""
    rec = await db.fetchrow(sql.query("submit_fast_path"), *new.params(), per_minute, default_max_pending, timeout=within)
    assert rec is not None
    verdict = Verdict(rec["outcome"])
    task = TaskRow.from_record(rec) if verdict in (Verdict.CREATED, Verdict.EXISTING) else None
    retry_after = rec["retry_after"]
    pending_limit = rec["pending_limit"]
    return Admission(
        verdict=verdict,
        task=task,
        retry_after=float(retry_after) if retry_after is not None else None,
        pending_limit=int(pending_limit) if pending_limit is not None else None,
    )


async def create(db: Conn, new: NewTask) -> TaskRow | None:
    """Inserts a task in CREATED without any limit; None when its idempotency key is taken."""
    rec = await db.fetchrow(sql.query("submit_insert_task"), *new.params())
    return TaskRow.from_record(rec) if rec is not None and rec["id"] is not None else None


async def take_rate_slot(db: Conn, tenant: str, *, per_minute: int, within: float | None = None) -> float | None:
    """Counts one submission in the tenant's minute window: None when counted, else seconds until the window ends."""
    retry_after = await db.fetchval(sql.query("submit_take_rate_slot"), tenant, per_minute, timeout=within)
    return float(retry_after) if retry_after is not None else None


async def queue_position(db: Conn, task: TaskRow, *, within: float | None = None) -> int:
    """1-based rank of a QUEUED task among its model's QUEUED tasks (priority, then queue time); 0 for any other."""
    if task.status is not Status.QUEUED or task.queued_at is None:
        return 0
    position = await db.fetchval(
        sql.query("submit_queue_position"), task.model_id, task.priority, task.queued_at, task.id, timeout=within
    )
    return int(position)


async def list_tasks(
    db: Conn,
    tenant: str,
    *,
    statuses: Collection[Status] = (),
    created_after: datetime | None = None,
    created_before: datetime | None = None,
    after: Cursor | None = None,
    limit: int,
    within: float | None = None,
) -> list[TaskRow]:
    """A tenant's tasks, newest first, strictly after the cursor; `statuses` empty means all."""
    rows = await db.fetch(
        sql.query("submit_list_tasks"),
        tenant,
        sorted(s.value for s in statuses) or None,
        created_after,
        created_before,
        after.at if after else None,
        after.task_id if after else None,
        limit,
        timeout=within,
    )
    return [TaskRow.from_record(r) for r in rows]
