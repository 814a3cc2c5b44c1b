"""The worker's own rows: its registry entry and its beat, its claim under the caps, and outputs kept for reuse.

The SQL is the `worker_*` blocks of sql/queries/worker.sql; the claim is one statement (functions/worker_claim.sql),
and so is a beat, however many attempts it renews.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from taskgate import sql
from taskgate.model import TaskRow
from taskgate.states import Status
from taskgate.store.pool import Conn
from taskgate.store.tasks import ResultRef, applied, logged


@dataclass(frozen=True, slots=True)
class Registration:
    """What a worker's registry row says about it."""

    worker_id: str
    models: tuple[str, ...]
    slots: int
    running: int
    device: str
    draining: bool
    control_address: str | None = None  # host:port of its WorkerControl server, once it serves
    devices: int = 0  # the devices it runs tasks on (GPUs, or one CPU)
    capacity: float | None = None  # its share of the cluster-wide cap (devices x slots per device); None: its slots


@dataclass(frozen=True, slots=True)
class ClusterLoad:
    """The cluster-wide cap on running tasks (floor of the live workers' summed capacities) and the tasks running
    under a live lease."""

    capacity: int
    running: int


class Verdict(enum.Enum):
    """What a worker's claim did: claimed the task, or why not."""

    CLAIMED = "claimed"
    NOT_FOUND = "not_found"  # no such task
    OTHER_MODEL = "other_model"  # the task is another model's
    FINISHED = "finished"  # the task is in a final state
    CAPPED = "capped"  # the model's cap or the cluster's slots are full
    REFUSED = "refused"  # a live lease, or a takeover that would reach max_worker_losses
    EARLY = "early"  # the level's QUEUED tasks are not due yet (wait_seconds until the first is)
    BUSY = "busy"  # every due task of the level is being claimed by another worker right now, or this worker runs
    # a task alone (it takes nothing else meanwhile)
    ALONE = "alone"  # the level's task that must run alone is reserved for this worker (task): take nothing new until
    # this worker holds no task, then claim again from the level


@dataclass(frozen=True, slots=True)
class WorkerClaim:
    """A worker's claim: the verdict, the new attempt (CLAIMED) or the current row, and a reusable output."""

    verdict: Verdict
    task: TaskRow | None  # None: no such task
    from_status: Status | None  # the state a claimed task left
    reusable: ResultRef | None  # a soft-cancelled run's output for the same request
    wait_seconds: float | None = None  # EARLY: until the level's first task is due


@dataclass(frozen=True, slots=True)
class BeatAttempt:
    """One attempt a worker runs, as its beat names it: the lease to renew, and new progress to write (None: none)."""

    task_id: int
    attempt: int
    progress: int | None = None


@dataclass(frozen=True, slots=True)
class Renewal:
    """An attempt that still holds its task after a beat: the row's version as the beat left it, and whether its
    progress moved (when it did not, the caller reads the row if it needs it)."""

    version: int
    progressed: bool


async def beat(
    db: Conn,
    attempts: Sequence[BeatAttempt],
    *,
    lease_seconds: float,
    worker: Registration | None = None,
    actor: str = "worker",
) -> dict[int, Renewal]:
    """One statement: renews every lease in `attempts` (fenced by its attempt), writes their new progress (each a
    guarded PROCESSING -> PROCESSING move, logged once), and records `worker`'s registry heartbeat when given.

    Returns the renewals by task id; a task absent from it is no longer its attempt's.
    """
    reg = worker or Registration("", (), 0, 0, "", False)
    rows = await db.fetch(
        *sql.bind(
            "worker_beat",
            task_ids=[a.task_id for a in attempts],
            attempts=[a.attempt for a in attempts],
            progress=[a.progress for a in attempts],
            lease_seconds=lease_seconds,
            worker_id=worker.worker_id if worker is not None else None,
            models=list(reg.models),
            slots=reg.slots,
            running=reg.running,
            device=reg.device,
            draining=reg.draining,
            actor=actor,
            control_address=reg.control_address,
            devices=reg.devices,
            capacity=reg.capacity,
        )
    )
    out = {}
    for rec in rows:
        task_id, version, progressed = rec["id"], rec["version"], rec["progressed"]
        if progressed:
            logged(task_id, Status.PROCESSING, Status.PROCESSING, version=version, attempt=rec["attempt"],
                   worker=rec["worker_id"], actor=actor, reason="progress")
        out[task_id] = Renewal(version, progressed)
    return out


async def register(db: Conn, worker: Registration) -> None:
    """Registers a worker or records its heartbeat (a beat renewing nothing)."""
    await beat(db, (), lease_seconds=0, worker=worker)


async def renew_lease(db: Conn, task_id: int, *, attempt: int, lease_seconds: float) -> bool:
    """Extends a running (or soft-cancelled, still running) attempt's lease; False when it no longer holds the task."""
    return task_id in await beat(db, [BeatAttempt(task_id, attempt)], lease_seconds=lease_seconds)


async def unregister(db: Conn, worker_id: str) -> None:
    """Removes a worker's registry row (a clean exit)."""
    await db.execute(sql.query("worker_delete"), worker_id)


async def cluster_load(db: Conn, *, lease_seconds: float, besides: int | None = None) -> ClusterLoad:
    """Capacity: floor of the summed capacities of workers heard from within `lease_seconds`; running: tasks under a
    live lease, soft-cancelled ones still running included (`besides` left out)."""
    rec = await db.fetchrow(sql.query("worker_cluster_load"), lease_seconds, besides)
    return ClusterLoad(rec["capacity"], rec["running"])


async def claim_for(
    db: Conn,
    task_id: int,
    *,
    model_id: str,
    cap: int,
    worker_id: str,
    lease_seconds: float,
    actor: str,
    reason: str | None = None,
    max_worker_losses: int | None = None,
    cluster_cap: bool = False,
) -> WorkerClaim:
    """A worker's claim for the dispatch message of `task_id` (a task of `model_id`), in one statement and its own
    durably committed transaction (writes are fenced by its attempt number): the fairest due QUEUED task of the
    message's (model, priority) level, else the message's own task while it is CREATED (or PROCESSING under a lapsed
    lease: a takeover).

    CAPPED when `cap` (if above 0) tasks of the model already run under a live lease (exact: counted under a per-model
    lock held to the commit), or (with `cluster_cap`) when the running tasks reach floor(sum of the live workers'
    capacities) (exact too: counted under one cluster-wide lock held to the commit).
    """
    rec = await db.fetchrow(
        *sql.bind(
            "worker_claim",
            task_id=task_id,
            model_id=model_id,
            cap=cap,
            cluster_cap=cluster_cap,
            worker_id=worker_id,
            lease_seconds=lease_seconds,
            max_worker_losses=max_worker_losses,
            actor=actor,
            reason=reason,
        )
    )
    verdict = Verdict(rec["verdict"])
    task = TaskRow.from_record(rec) if rec["id"] is not None else None
    old = Status(rec["old_status"]) if rec["old_status"] is not None else None
    reusable = None
    if rec["reusable_uri"] is not None:
        reusable = ResultRef(
            rec["reusable_uri"], rec["reusable_content_type"], rec["reusable_size"], rec["reusable_sha256"], reused=True
        )
    if verdict is Verdict.CLAIMED and task is not None and old is not None:
        applied(task, old, actor=actor, reason=reason)
    return WorkerClaim(verdict, task, old, reusable, rec["wait_seconds"])


async def keep_reusable(db: Conn, task_id: int, *, attempt: int, result: ResultRef) -> bool:
    """Keeps a soft-cancelled attempt's output for an identical request; False when the guard or the key says no."""
    kept = await db.fetchval(
        *sql.bind(
            "worker_keep_reusable",
            task_id=task_id,
            attempt=attempt,
            uri=result.uri,
            content_type=result.content_type,
            size=result.size,
            sha256=result.sha256,
        )
    )
    return kept is not None


async def name_checkpoint(db: Conn, task_id: int, *, attempt: int, uri: str) -> bool:
    """Names a running attempt's next checkpoint object before it is stored; False when the attempt no longer runs."""
    return await db.fetchval(sql.query("worker_checkpoint_intent"), task_id, attempt, uri) is not None


async def name_preview(db: Conn, task_id: int, *, attempt: int, uri: str) -> bool:
    """Names a running attempt's next preview image before it is stored; False when the attempt no longer runs."""
    return await db.fetchval(sql.query("worker_preview_intent"), task_id, attempt, uri) is not None


async def record_checkpoint(
    db: Conn, task_id: int, *, attempt: int, uri: str, step: int, deleted: Sequence[str] = ()
) -> list[str] | None:
    """Records a running attempt's newest checkpoint, `deleted` the objects deleted since its last record; returns the
    objects to delete now (the replaced one among them), or None when the attempt no longer runs the task."""
    rows = await db.fetch(
        *sql.bind("worker_checkpoint", task_id=task_id, attempt=attempt, uri=uri, step=step, deleted=list(deleted))
    )
    return list(rows[0]["checkpoint_garbage"]) if rows else None


async def drop_checkpoint(db: Conn, task_id: int) -> bool:
    """Forgets an ended task's checkpoints (their objects already deleted)."""
    return await db.fetchval(sql.query("worker_drop_checkpoint"), task_id) is not None
