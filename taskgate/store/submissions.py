"""Admission of new tasks, a batch at a time (rate slots, tenant locks, idempotent lookups, pending limits, one
insert), their move to QUEUED once dispatched, and the tenant's reads.

The task INSERT has one author, the `insert_tasks` SQL function (sql/functions/submit_fast_path.sql): `admit` runs it
inside `submit_tasks`, `create` runs it alone for rows that skip the limits (tests, tools). `within`: the seconds
a statement may run before asyncpg cancels it on the server (TimeoutError).
"""

from __future__ import annotations

import dataclasses
import enum
import operator
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from taskgate import bus, sql
from taskgate.model import TaskRow
from taskgate.paging import Cursor
from taskgate.states import Status
from taskgate.store.pool import Conn
from taskgate.store.tasks import applied


class AdmitVerdict(enum.StrEnum):
    """What `admit` did with a submission."""

    CREATED = "created"
    EXISTING = "existing"  # the idempotency key already names a task: nothing inserted
    RATE_LIMITED = "rate_limited"
    NO_TENANT = "no_tenant"
    TOO_MANY_PENDING = "too_many_pending"
    QUOTA_EXCEEDED = "quota_exceeded"  # its estimate does not fit the tenant's GPU-second or token budget


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
    trace_context: dict[str, str] | None = None  # W3C headers of the submitting call's span (tracing on)
    start_after: datetime | None = None  # no claim before it
    max_queue_seconds: float | None = None  # the queue's TTL: TIMEOUT QUEUE_TTL_EXPIRED if it waits longer
    end_user: str = ""  # the tenant's own user the task is for ('': the tenant itself); keys are scoped to it



# The insert's columns by name, in the order the submit queries number their parameters ($1..$19, `p_<name> => $n`
# in sql/queries/submit.sql; test_submit_batch checks that the two agree): the one place a field meets its column.
COLUMNS: dict[str, Callable[[NewTask], object]] = {
    "id": lambda t: t.id,
    "user_id": lambda t: t.user_id,
    "idempotency_key": lambda t: t.idempotency_key,
    "idempotency_derived": lambda t: t.key_derived,
    "request_hash": lambda t: t.request_hash,
    "task_type": lambda t: t.task_type,
    "model_id": lambda t: t.model_id,
    "prompt": lambda t: t.prompt,
    "request_payload": lambda t: t.payload,
    "metadata": lambda t: t.metadata,
    "priority": lambda t: t.priority,
    "queue_name": lambda t: bus.task_subject(t.model_id, t.priority),
    "max_retries": lambda t: t.max_retries,
    "callback_url": lambda t: t.callback_url,
    "callback_events": lambda t: ",".join(t.callback_events),  # a text[] per item cannot be an array element
    "trace_context": lambda t: t.trace_context,
    "start_after": lambda t: t.start_after,
    "max_queue_seconds": lambda t: t.max_queue_seconds,
    "end_user": lambda t: t.end_user,
}


def by_column(tasks: Sequence[NewTask]) -> dict[str, list[object]]:
    """One array per column of COLUMNS by its name, one element per task: a named block's parameters."""
    return {name: [column(t) for t in tasks] for name, column in COLUMNS.items()}


def admission_rows(batch: Sequence[Candidate]) -> list[dict[str, object]]:
    """The batch as submit_tasks takes it: one row per submission with admission_item's named fields (the task's
    columns by COLUMNS, its tenant's per-minute limit, its GPU-seconds estimate and the tokens it reserves), for the
    jsonb codec to send."""
    rows = []
    for c in batch:
        row = {name: column(c.new) for name, column in COLUMNS.items()}
        row["per_minute"] = c.per_minute
        row["gpu_estimate"] = c.gpu_estimate
        row["token_estimate"] = c.token_estimate
        for name, value in row.items():
            if isinstance(value, datetime):  # JSON has no time: PostgreSQL reads ISO 8601 back into timestamptz
                row[name] = value.isoformat()
        rows.append(row)
    return rows


@dataclass(frozen=True, slots=True)
class Candidate:
    """One submission to admit: the task, the tenant's per-minute limit (None: its rate slot is already taken), the
    GPU-seconds its model's task is estimated at when the run history has none, and the tokens a chat task reserves
    of a token budget (its max_output_tokens and counted input; None: not a chat task)."""

    new: NewTask
    per_minute: int | None
    gpu_estimate: float = 0.0
    token_estimate: int | None = None


GPU_SECONDS = "gpu_seconds"  # a budget's unit (Budget.unit)
TOKENS = "tokens"


@dataclass(frozen=True, slots=True)
class Budget:
    """Why a submission did not fit its tenant's budget: the window ('day' or 'month', UTC) that is short, what is
    left in it and the submission's estimate, both in the budget's unit ('gpu_seconds' or 'tokens')."""

    window: str
    left: float
    estimate: float
    unit: str = GPU_SECONDS


@dataclass(frozen=True, slots=True)
class History:
    """The run history a budget's estimate reads: successful runs within `seconds`, at most `runs` of them."""

    seconds: float = 86400.0
    runs: int = 20


@dataclass(frozen=True, slots=True)
class EndUserLimits:
    """The limits of each end user of a tenant that sets none of its own (tenant.max_pending_per_end_user,
    tenant.submits_per_minute_per_end_user)."""

    max_pending: int = 3
    per_minute: int = 30


@dataclass(frozen=True, slots=True)
class Admission:
    """The verdict, the task (created or existing), seconds until a slot frees (rate limited) or the budget's window
    resets (quota exceeded), the pending limit (the refusing scope's, for TOO_MANY_PENDING), what did not fit the
    budget, and for a refusal by a limit its scope ('end_user' or 'tenant') and, when rate limited, its per-minute
    allowance."""

    verdict: AdmitVerdict
    task: TaskRow | None
    retry_after: float | None
    pending_limit: int | None
    budget: Budget | None = None
    scope: str | None = None
    rate_limit: int | None = None


async def admit(
    db: Conn, batch: Sequence[Candidate], *, default_max_pending: int, history: History = History(),
    end_users: EndUserLimits = EndUserLimits(), now: datetime | None = None, within: float | None = None,
) -> list[Admission]:
    """Admits a batch in one statement; one Admission per candidate, in order, as if admitted one by one. `now`: the
    budgets' clock (None: the database's)."""
    rows = await db.fetch(
        *sql.bind(
            "submit_tasks",
            items=admission_rows(batch),
            default_max_pending=default_max_pending,
            history_seconds=history.seconds,
            history_runs=history.runs,
            now=now,
            default_max_pending_per_end_user=end_users.max_pending,
            default_per_minute_per_end_user=end_users.per_minute,
        ),
        timeout=within,
    )
    out = []
    for rec in rows:
        verdict = AdmitVerdict(rec["outcome"])
        retry_after = rec["retry_after"]
        pending_limit = rec["pending_limit"]
        budget = None
        if verdict is AdmitVerdict.QUOTA_EXCEEDED:
            if rec["budget_unit"] == TOKENS:
                budget = Budget(rec["budget_window"], float(rec["budget_left"]), float(rec["token_estimate"]), TOKENS)
            else:
                budget = Budget(rec["budget_window"], float(rec["budget_left"]), float(rec["gpu_estimate"]))
        out.append(Admission(
            verdict=verdict,
            task=TaskRow.from_record(rec) if verdict in (AdmitVerdict.CREATED, AdmitVerdict.EXISTING) else None,
            retry_after=float(retry_after) if retry_after is not None else None,
            pending_limit=int(pending_limit) if pending_limit is not None else None,
            budget=budget,
            scope=rec["limit_scope"],
            rate_limit=rec["rate_limit"],
        ))
    assert len(out) == len(batch)
    return out


async def create(db: Conn, new: NewTask) -> TaskRow | None:
    """Inserts a task in CREATED without any limit; None when its idempotency key is taken."""
    rec = await db.fetchrow(*sql.bind("submit_insert_tasks", **by_column([new])))
    return TaskRow.from_record(rec) if rec is not None else None


# Every field of a TaskRow in __init__'s order (each one an __init__ parameter): TaskRow(*_ALL_FIELDS(row)) copies a
# row in about 2 us, where dataclasses.replace took about 9 (py-spy: replace was 4.7% of a bulk submit process).
_ALL_FIELDS = operator.attrgetter(*(f.name for f in dataclasses.fields(TaskRow)))
assert all(f.init for f in dataclasses.fields(TaskRow))


async def queue_created(
    db: Conn, tasks: Sequence[TaskRow], *, actor: str, reason: str | None = None, within: float | None = None
) -> list[TaskRow]:
    """CREATED -> QUEUED for tasks whose dispatch is on JetStream, in one statement; returns the tasks it moved: each
    the caller's row with the columns this move set (the statement returns only those).

    Committed asynchronously: a lost QUEUED mark leaves the task CREATED, which the scheduler dispatches again. A task
    no longer CREATED (a worker's claim outran this, or a cancel) is left as it is, and so is one whose row another
    transaction holds (a claim under way): the move never waits for another's commit.
    """
    rows = await db.fetch(sql.query("submit_queue_created"), [t.id for t in tasks], actor, reason, timeout=within)
    given = {t.id: t for t in tasks}
    moved = []
    for rec in rows:
        # a copy through _ALL_FIELDS: the caller's row may still be answering its submission
        row = TaskRow(*_ALL_FIELDS(given[rec["id"]]))
        row.status, row.version, row.queued_at = Status(rec["status"]), rec["version"], rec["queued_at"]
        row.updated_at, row.last_actor, row.last_reason = rec["updated_at"], rec["last_actor"], rec["last_reason"]
        applied(row, Status.CREATED, actor=actor, reason=reason)
        moved.append(row)
    return moved


@dataclass(frozen=True, slots=True)
class Slot:
    """One submission's rate slot: `retry_after` (seconds until the window ends), `scope` ('end_user' or 'tenant')
    and `limit` (that scope's per-minute allowance) when refused; `replay` when its key already names a task (no slot
    taken)."""

    retry_after: float | None
    replay: bool = False
    scope: str | None = None
    limit: int | None = None


async def take_rate_slots(
    db: Conn, tenant: str, *, per_minute: int, keys: Sequence[str], end_users: Sequence[str] | None = None,
    per_end_user: int = EndUserLimits().per_minute, within: float | None = None,
) -> list[Slot]:
    """Counts submissions (one per idempotency key given, '' for none, each of its end user: '' the tenant) in the
    end users' and the tenant's minute windows, in one round trip; a key that already names a task of that end user
    takes none. `per_end_user`: each end user's allowance unless the tenant sets its own."""
    eus = list(end_users) if end_users is not None else [""] * len(keys)
    rows = await db.fetch(
        *sql.bind(
            "submit_take_rate_slots",
            tenant=tenant,
            per_minute=per_minute,
            keys=list(keys),
            end_users=eus,
            per_end_user=per_end_user,
        ),
        timeout=within,
    )
    return [
        Slot(
            float(r["retry_after"]) if r["retry_after"] is not None else None, r["replay"], r["scope"], r["rate_limit"]
        )
        for r in rows
    ]


async def task_by_key(
    db: Conn, tenant: str, key: str, *, end_user: str = "", within: float | None = None
) -> TaskRow | None:
    """The task holding idempotency key `key` for the tenant's `end_user` ('': the tenant itself), or None."""
    rec = await db.fetchrow(sql.query("submit_task_by_key"), tenant, key, end_user, timeout=within)
    return None if rec is None else TaskRow.from_record(rec)


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
        *sql.bind(
            "submit_list_tasks",
            user_id=tenant,
            statuses=sorted(s.value for s in statuses) or None,
            created_after=created_after,
            created_before=created_before,
            after_at=after.at if after else None,
            after_id=after.task_id if after else None,
            limit=limit,
        ),
        timeout=within,
    )
    return [TaskRow.from_record(r) for r in rows]
