"""What a task's ETA is computed from: its place under the real dispatch order (fair share inside its level, the
due tasks of its model's levels), its model's recent run time for its size class, and the live workers' slots shared
among their models (the `eta_inputs` block of sql/queries/eta.sql; taskgate.eta turns them into a position and
times)."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime

from taskgate import sql
from taskgate.states import Priority, Status
from taskgate.store.pool import Conn


@dataclass(frozen=True, slots=True)
class EtaInputs:
    """One task as the database sees it now, with the recent history of tasks like it."""

    task_id: int
    status: Status
    version: int
    progress: int
    model_id: str
    level_position: int  # claims its (model, priority) level makes up to and including it, fair share; 0: not QUEUED
    run_seconds: float | None  # median start-to-finish of the recent successful runs; None: none in the window
    runs: int  # how many recent runs the median is over
    slots: float  # the live, not draining workers' slots serving the model, shared among their models (QUEUED only)
    now: datetime
    priority: int = Priority.NORMAL
    queued: Mapping[int, int] = field(default_factory=dict)  # due QUEUED tasks of each of its model's levels
    max_output_tokens: int | None = None  # a chat task's (None: another task type)
    token_seconds: float | None = None  # median seconds per output token of the recent runs that generated tokens
    mean_output_tokens: float | None = None  # and their mean output tokens


@dataclass(frozen=True, slots=True)
class RunHistory:
    """A model's recent successful runs of one task type and size class: the median run seconds (None: no run in
    the window) and how many runs; of those that generated tokens (chat), the median seconds per output token and the
    mean output tokens (None: none did)."""

    run_seconds: float | None
    runs: int
    token_seconds: float | None = None
    mean_output_tokens: float | None = None


async def eta_inputs(
    db: Conn,
    task_ids: Collection[int],
    *,
    window_seconds: float,
    max_runs: int,
    alive_seconds: float,
    weights: tuple[int, int, int] = (6, 3, 1),
    within: float | None = None,
) -> dict[int, EtaInputs]:
    """The inputs of each task's ETA, by id; a missing task is absent. One statement, index-backed.
    `weights`: the workers' fetch weights of HIGH, NORMAL and LOW."""
    rows = await db.fetch(
        *sql.bind(
            "eta_inputs",
            task_ids=list(task_ids),
            window_seconds=window_seconds,
            max_runs=max_runs,
            alive_seconds=alive_seconds,
            weights=list(weights),
        ),
        timeout=within,
    )
    return {
        rec["id"]: EtaInputs(
            task_id=rec["id"],
            status=Status(rec["status"]),
            version=rec["version"],
            progress=rec["progress"],
            model_id=rec["model_id"],
            level_position=int(rec["level_position"] or 0),
            run_seconds=float(rec["run_seconds"]) if rec["run_seconds"] is not None else None,
            runs=int(rec["runs"]),
            slots=float(rec["slots"] or 0),
            now=rec["now"],
            priority=rec["priority"],
            queued={
                Priority.HIGH: int(rec["queued_high"]), Priority.NORMAL: int(rec["queued_normal"]),
                Priority.LOW: int(rec["queued_low"]),
            },
            max_output_tokens=rec["max_output_tokens"],
            token_seconds=rec["token_seconds"],
            mean_output_tokens=rec["mean_output_tokens"],
        )
        for rec in rows
    }


@dataclass(frozen=True, slots=True)
class TenantLevel:
    """One tenant at one (model, priority) level of a queue snapshot."""

    model_id: str
    priority: int
    user_id: str
    pass_: float | None  # its fair-share pass (None: it has none yet)
    floor: float | None  # the level's floor (None: nothing claimed there yet)
    weight: float  # its share weight
    at: Sequence[int]  # its due QUEUED tasks' queued_at (epoch microseconds), in claim order
    ids: Sequence[int]  # and their ids, in the same order
    end_users: Sequence[str] = ()  # and their end users, in the same order
    end_user_floor: float = 0.0  # where a tenant's end user without a pass starts (fair_share.end_user_floor)
    end_user_passes: Mapping[str, float] = field(default_factory=dict)  # its end users' passes (end_user_share)


@dataclass(frozen=True, slots=True)
class QueueRows:
    """A queue snapshot as read: the database's now, every level's tenants, and the live workers' (models, slots)."""

    now: datetime
    tenants: list[TenantLevel]
    workers: list[tuple[tuple[str, ...], float]]


async def queue_snapshot(db: Conn, *, alive_seconds: float, within: float | None = None) -> QueueRows:
    """The whole due queue, in two statements (this is what a refresh costs, once per period; a poll costs none)."""
    rows = await db.fetch(sql.query("queue_snapshot_levels"), timeout=within)
    head = await db.fetchrow(sql.query("queue_snapshot_workers"), alive_seconds, timeout=within)
    assert head is not None
    return QueueRows(
        now=head["now"],
        tenants=[
            TenantLevel(
                model_id=r["model_id"], priority=r["priority"], user_id=r["user_id"],
                pass_=r["pass"], floor=r["floor"], weight=float(r["weight"]), at=r["at"], ids=r["ids"],
                end_users=r["end_users"], end_user_floor=float(r["end_user_floor"]),
                end_user_passes={str(k): float(v) for k, v in (r["end_user_passes"] or {}).items()},
            )
            for r in rows
        ],
        workers=[(tuple(w["models"]), float(w["slots"])) for w in head["workers"]],
    )


async def run_history(
    db: Conn, model_id: str, task_type: str, size_class: int, *, window_seconds: float, max_runs: int,
    within: float | None = None,
) -> RunHistory:
    """A model's latest successful runs of one task type and size class, summed up; a bounded read of
    task_recent_runs_idx."""
    rec = await db.fetchrow(
        *sql.bind(
            "eta_run_history",
            model_id=model_id,
            task_type=task_type,
            size_class=size_class,
            window_seconds=window_seconds,
            max_runs=max_runs,
        ),
        timeout=within,
    )
    assert rec is not None
    return RunHistory(
        float(rec["run_seconds"]) if rec["run_seconds"] is not None else None, int(rec["runs"]), rec["token_seconds"],
        rec["mean_output_tokens"],
    )
