"""The scheduler's scans: due rows in bounded, locked batches, plus the safety nets and the queue gauges.

Every scan takes an optional `now` (None: the database's now()) so tests can move the clock. The task queries lock
what they return with FOR UPDATE SKIP LOCKED, so run them inside the caller's transaction; the moves themselves
are the typed ones of store.tasks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime

from taskgate import sql
from taskgate.model import TaskRow
from taskgate.store.pool import Conn


@dataclass(frozen=True, slots=True)
class ModelLoad:
    """One model's queue: how many tasks wait, how long the oldest has waited, and how many run."""

    model_id: str
    queued: int
    oldest_queued_age: float | None
    processing: int


def _per_model(timeouts: Mapping[str, float]) -> tuple[list[str], list[float]]:
    models = sorted(timeouts)
    return models, [timeouts[m] for m in models]


async def _tasks(db: Conn, query: str, *args: object) -> list[TaskRow]:
    return [TaskRow.from_record(r) for r in await db.fetch(sql.query(query), *args)]


async def created_due(db: Conn, *, now: datetime | None = None, timeout_seconds: float, limit: int) -> list[TaskRow]:
    """CREATED tasks untouched for `timeout_seconds` (their dispatch was lost), oldest first, locked."""
    return await _tasks(db, "sched_created_due", now, timeout_seconds, limit)


async def queue_expired(db: Conn, *, now: datetime | None = None, limit: int) -> list[TaskRow]:
    """QUEUED tasks past the queue TTL they were submitted with, soonest first, locked."""
    return await _tasks(db, "sched_queue_expired", now, limit)


async def queued_due(
    db: Conn, *, now: datetime | None = None, timeouts: Mapping[str, float], default_seconds: float, limit: int
) -> list[TaskRow]:
    """QUEUED tasks waiting past their model's queue timeout (`default_seconds` for a model not in `timeouts`) at a
    model whose queue does not move (no claim within the timeout, nothing running), locked."""
    models, seconds = _per_model(timeouts)
    smallest = min([default_seconds, *seconds])  # the bound the index range scan uses
    rows = await db.fetch(
        *sql.bind(
            "sched_queued_due",
            now=now,
            models=models,
            seconds=seconds,
            default_seconds=default_seconds,
            smallest=smallest,
            limit=limit,
        )
    )
    return [TaskRow.from_record(r) for r in rows]


async def level_holders(db: Conn, levels: list[tuple[str, int]]) -> dict[tuple[str, int], int]:
    """Per (model, priority): the tasks that should hold one of its dispatch messages (QUEUED, or holding a lease)."""
    if not levels:
        return {}
    rows = await db.fetch(sql.query("sched_level_holders"), [m for m, _ in levels], [p for _, p in levels])
    return {(r["model_id"], r["priority"]): r["holders"] for r in rows}


async def lease_expired(db: Conn, *, now: datetime | None = None, limit: int) -> list[TaskRow]:
    """PROCESSING tasks whose lease ran out (the worker is gone), locked."""
    return await _tasks(db, "sched_lease_expired", now, limit)


async def lost_holding(db: Conn, worker_id: str | None) -> int:
    """How many tasks a lost worker held when its first lost lease was found (at least 1; functions/worker_lost.sql):
    above 1, each of them died in company."""
    if worker_id is None:
        return 1
    return int(await db.fetchval(sql.query("sched_worker_lost_holding"), worker_id))


async def processing_overdue(
    db: Conn,
    *,
    now: datetime | None = None,
    timeouts: Mapping[str, float],
    default_seconds: float,
    grace_seconds: float,
    limit: int,
) -> list[TaskRow]:
    """Live PROCESSING tasks past their model's processing timeout (plus `grace_seconds` once granted), locked."""
    models, seconds = _per_model(timeouts)
    rows = await db.fetch(
        *sql.bind(
            "sched_processing_overdue",
            now=now,
            models=models,
            seconds=seconds,
            default_seconds=default_seconds,
            grace_seconds=grace_seconds,
            limit=limit,
        )
    )
    return [TaskRow.from_record(r) for r in rows]


async def grant_grace(db: Conn, task_id: int, *, attempt: int) -> bool:
    """The one grace extension of a slow but live attempt (not a transition: no new version); False if not granted."""
    return await db.fetchval(sql.query("sched_grant_grace"), task_id, attempt) is not None


async def add_missing_dead_letters(
    db: Conn, *, now: datetime | None = None, window_seconds: float, reason: str, limit: int
) -> int:
    """Dead letters for recent FAILED tasks that exhausted their retries but have none; returns how many were added."""
    rows = await db.fetch(sql.query("sched_dead_letter_missing"), now, window_seconds, reason, limit)
    return len(rows)


async def lapsed_holds(db: Conn, *, now: datetime | None = None, limit: int) -> int:
    """Ends the lapsed leases of soft-cancelled attempts (their worker is gone); returns how many."""
    return len(await db.fetch(sql.query("sched_lapsed_holds"), now, limit))


@dataclass(frozen=True, slots=True)
class Preempted:
    """A running attempt the scheduler asks to checkpoint and release for a waiting task of higher priority."""

    task_id: int
    attempt: int
    model_id: str
    trace_context: dict[str, str] | None


async def preempt(
    db: Conn, *, now: datetime | None = None, after: Mapping[str, float], window_seconds: float
) -> list[Preempted]:
    """Marks (preempted_at) at most one running attempt per model in `after` (model -> preempt_after seconds) that a
    waiting task of higher priority should displace; returns them."""
    if not after:
        return []
    models = sorted(after)
    recs = await db.fetch(sql.query("sched_preempt"), now, models, [after[m] for m in models], window_seconds)
    return [
        Preempted(r["id"], r["attempt"], r["model_id"], _json_object(r["trace_context"])) for r in recs
    ]


def _json_object(value: object) -> dict[str, str] | None:
    if isinstance(value, str):
        import json

        value = json.loads(value)
    return {str(k): str(v) for k, v in value.items()} if isinstance(value, dict) else None


async def forget_workers(db: Conn, *, now: datetime | None = None, silent_seconds: float, limit: int) -> list[str]:
    """Deletes registry rows of workers silent for `silent_seconds`; returns their ids."""
    return [r["id"] for r in await db.fetch(sql.query("sched_forget_workers"), now, silent_seconds, limit)]


async def queue_gauges(db: Conn) -> list[ModelLoad]:
    """Per model with QUEUED or PROCESSING tasks: the counts and the oldest QUEUED task's age (seconds)."""
    return [
        ModelLoad(r["model_id"], r["queued"], r["oldest_queued_age"], r["processing"])
        for r in await db.fetch(sql.query("sched_queue_gauges"))
    ]


async def workers_alive(db: Conn, *, lease_seconds: float) -> int:
    """Workers whose last heartbeat is within `lease_seconds`."""
    return int(await db.fetchval(sql.query("sched_workers_alive"), lease_seconds))


@dataclass(frozen=True, slots=True)
class Purged:
    """What one retention batch removed: rows, and the outputs nothing refers to any more (the caller deletes them
    from the result store before it commits, so a failed delete leaves the rows for the next pass)."""

    rows: int
    orphans: list[str]


@dataclass(frozen=True, slots=True)
class RetentionCounts:
    """What a purge at one cut-off would delete, and the finished tasks past it that it keeps, by reason."""

    tasks: int
    results: int
    reusable_results: int
    kept_webhook: int = 0  # a webhook still owed (the terminal one PENDING, or a delivery being retried)
    kept_running: int = 0  # soft-cancelled, its attempt still running under its lease


async def unreferenced(db: Conn, outputs: list[tuple[str, str, str]]) -> list[str]:
    """Of (user id, request hash, uri) outputs, the uris no kept task output and no reusable output still refers to."""
    if not outputs:
        return []
    users, hashes, uris = (list(column) for column in zip(*outputs, strict=True))
    return [r["uri"] for r in await db.fetch(sql.query("retention_unreferenced"), users, hashes, uris)]


async def purge_tasks(db: Conn, *, now: datetime | None = None, older_than_seconds: float, limit: int) -> Purged:
    """Deletes finished tasks older than the cut-off (their history, deliveries, attempt logs and dead letters
    cascade), oldest first, locked; never one whose webhook is still owed or whose soft-cancelled attempt still runs.
    Run inside the caller's transaction."""
    recs = await db.fetch(sql.query("retention_expired_tasks"), now, older_than_seconds, limit)
    if not recs:
        return Purged(0, [])
    await db.execute(sql.query("retention_delete_tasks"), [r["id"] for r in recs])
    kept = [
        (r["user_id"], r["request_hash"], r["result_uri"])
        for r in recs
        if r["result_uri"] and r["result_expired_at"] is None
    ]
    previews = [uri for r in recs for uri in r["preview_uris"] or []]  # each a task's own: no other row refers to it
    return Purged(len(recs), [*await unreferenced(db, kept), *previews])


async def purge_checkpoints(db: Conn, *, limit: int) -> list[str]:
    """Forgets the step checkpoints of ended tasks, oldest first, locked; returns their objects for the caller to
    delete. Run inside the caller's transaction."""
    recs = await db.fetch(sql.query("retention_ended_checkpoints"), limit)
    return [uri for r in recs for uri in [*(r["garbage"] or []), *([r["uri"]] if r["uri"] else [])]]


async def purge_results(db: Conn, *, now: datetime | None = None, older_than_seconds: float, limit: int) -> Purged:
    """Marks the outputs of tasks finished before the cut-off as deleted (result_expired_at), oldest first, locked;
    run inside the caller's transaction."""
    recs = await db.fetch(sql.query("retention_expire_results"), now, older_than_seconds, limit)
    outputs = [(r["user_id"], r["request_hash"], r["result_uri"]) for r in recs]
    return Purged(len(recs), await unreferenced(db, outputs))


async def purge_previews(db: Conn, *, now: datetime | None = None, older_than_seconds: float, limit: int) -> list[str]:
    """Forgets the preview images of tasks finished before the cut-off, oldest first, locked; returns them for the
    caller to delete. Run inside the caller's transaction."""
    recs = await db.fetch(sql.query("retention_expire_previews"), now, older_than_seconds, limit)
    return [uri for r in recs for uri in r["uris"] or []]


async def purge_reusable(db: Conn, *, now: datetime | None = None, older_than_seconds: float, limit: int) -> Purged:
    """Deletes reusable outputs kept since before the cut-off, oldest first, locked; run inside the caller's
    transaction."""
    recs = await db.fetch(sql.query("retention_delete_reusable"), now, older_than_seconds, limit)
    outputs = [(r["user_id"], r["request_hash"], r["result_uri"]) for r in recs]
    return Purged(len(recs), await unreferenced(db, outputs))


async def purge_inputs(db: Conn, *, now: datetime | None = None, older_than_seconds: float, limit: int) -> Purged:
    """Deletes input images unused since before the cut-off that no kept task of their tenant runs from, oldest first,
    locked; the orphans are the objects no tenant's row names any more. Run inside the caller's transaction: the
    objects' locks last until it ends."""
    recs = await db.fetch(sql.query("retention_delete_inputs"), now, older_than_seconds, limit)
    if not recs:
        return Purged(0, [])
    orphans = await db.fetch(
        sql.query("retention_unreferenced_inputs"), [r["sha256"] for r in recs], [r["uri"] for r in recs]
    )
    return Purged(len(recs), [r["uri"] for r in orphans])


async def purge_events(db: Conn, *, now: datetime | None = None, older_than_seconds: float, limit: int) -> int:
    """Deletes relayed history rows older than the cut-off of tasks finished before it (their webhook deliveries and
    attempt logs cascade), oldest first, skipping locked rows; returns how many."""
    return len(await db.fetch(sql.query("retention_delete_events"), now, older_than_seconds, limit))


async def retention_counts(db: Conn, *, now: datetime | None = None, older_than_seconds: float) -> RetentionCounts:
    """What purging at this cut-off would delete (a dry run), and what it keeps."""
    rec = await db.fetchrow(sql.query("retention_counts"), now, older_than_seconds)
    return RetentionCounts(
        rec["tasks"], rec["results"], rec["reusable_results"], rec["kept_webhook"], rec["kept_running"]
    )
