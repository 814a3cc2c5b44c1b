"""What a task's ETA is computed from: its queue position, its model's recent run time for its size class, and the
live workers' slots (the `eta_inputs` block of sql/queries/eta.sql; taskgate.eta turns them into times)."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime

from taskgate import sql
from taskgate.states import Status
from taskgate.store.pool import Conn


@dataclass(frozen=True, slots=True)
class EtaInputs:
    """One task as the database sees it now, with the recent history of tasks like it."""

    task_id: int
    status: Status
    version: int
    progress: int
    model_id: str
    queue_position: int  # 1-based among its model's QUEUED tasks; 0 when not QUEUED
    run_seconds: float | None  # median start-to-finish of the recent successful runs; None: none in the window
    runs: int  # how many recent runs the median is over
    slots: int  # slots of the live, not draining workers serving the model (QUEUED only, else 0)
    now: datetime


async def eta_inputs(
    db: Conn,
    task_ids: Collection[int],
    *,
    window_seconds: float,
    max_runs: int,
    alive_seconds: float,
    within: float | None = None,
) -> dict[int, EtaInputs]:
    """The inputs of each task's ETA, by id; a missing task is absent. One statement, index-backed."""
    rows = await db.fetch(
        sql.query("eta_inputs"), list(task_ids), window_seconds, max_runs, alive_seconds, timeout=within
    )
    return {
        rec["id"]: EtaInputs(
            task_id=rec["id"],
            status=Status(rec["status"]),
            version=rec["version"],
            progress=rec["progress"],
            model_id=rec["model_id"],
            queue_position=int(rec["queue_position"]),
            run_seconds=float(rec["run_seconds"]) if rec["run_seconds"] is not None else None,
            runs=int(rec["runs"]),
            slots=int(rec["slots"]),
            now=rec["now"],
        )
        for rec in rows
    }
