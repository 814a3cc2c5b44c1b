"""ETA beside the queue position: when a task should start and finish, from recent history, never a constant.

A QUEUED task at position p starts after p x its model's recent run time (for its size class) / the live slots
serving the model, and finishes one run time later; a PROCESSING task finishes after the part of a run time its
progress has not covered. Without recent successful runs of that model and size class, or without live workers for
a queued task, there is no estimate: the fields stay unset.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from taskgate.config import Settings
from taskgate.model import timestamp
from taskgate.states import Status
from taskgate.store import Conn
from taskgate.store.estimates import EtaInputs, eta_inputs
from taskgate.v1 import task_pb2


@dataclass(frozen=True, slots=True)
class Estimate:
    """A task's queue position and ETA as of one read of the database (`status`: the task's state then)."""

    status: Status
    queue_position: int
    start: datetime | None = None
    finish: datetime | None = None

    def stamp(self, msg: task_pb2.Task | task_pb2.TaskEvent) -> None:
        """Sets estimated_start and estimated_finish on a message, each when known."""
        if self.start is not None:
            msg.estimated_start.CopyFrom(timestamp(self.start))
        if self.finish is not None:
            msg.estimated_finish.CopyFrom(timestamp(self.finish))


def estimate(inputs: EtaInputs, *, cap: int = 0) -> Estimate:
    """The ETA the inputs support; `cap`: the model's concurrency cap across workers (0: none)."""
    run = inputs.run_seconds
    if run is None:
        return Estimate(inputs.status, inputs.queue_position)
    if inputs.status is Status.QUEUED:
        slots = min(inputs.slots, cap) if cap > 0 else inputs.slots
        if slots <= 0:
            return Estimate(inputs.status, inputs.queue_position)  # nothing serves the model now: no honest start time
        start = inputs.now + timedelta(seconds=inputs.queue_position * run / slots)
        return Estimate(inputs.status, inputs.queue_position, start, start + timedelta(seconds=run))
    if inputs.status is Status.PROCESSING:
        left = run * (100 - min(max(inputs.progress, 0), 100)) / 100
        return Estimate(inputs.status, 0, None, inputs.now + timedelta(seconds=left))
    return Estimate(inputs.status, inputs.queue_position)


async def estimates(
    db: Conn, task_ids: Collection[int], settings: Settings, *, within: float | None = None
) -> dict[int, Estimate]:
    """Each task's estimate by id, in one statement; a missing task is absent."""
    found = await eta_inputs(
        db,
        task_ids,
        window_seconds=settings.eta_history_seconds,
        max_runs=settings.eta_history_runs,
        alive_seconds=settings.lease_seconds,
        within=within,
    )
    out = {}
    for task_id, inputs in found.items():
        spec = settings.models.get(inputs.model_id)
        out[task_id] = estimate(inputs, cap=spec.max_concurrency if spec else 0)
    return out


async def estimate_task(db: Conn, task_id: int, settings: Settings, *, within: float | None = None) -> Estimate | None:
    """One task's estimate; None when it does not exist."""
    return (await estimates(db, [task_id], settings, within=within)).get(task_id)


ESTIMATED = frozenset({Status.QUEUED, Status.PROCESSING})  # the states whose tasks carry a position and an ETA


async def current(
    db: Conn, task_id: int, status: Status, settings: Settings, *, within: float | None = None
) -> Estimate | None:
    """The estimate of a task seen in `status`, while it is still there: None for a state without one (not QUEUED or
    PROCESSING) and for a task that has moved on since it was seen."""
    return (await current_many(db, [(task_id, status)], settings, within=within))[0]


async def current_many(
    db: Conn, seen: Sequence[tuple[int, Status]], settings: Settings, *, within: float | None = None
) -> list[Estimate | None]:
    """`current` of each (task id, status) seen, in order, in one statement (none when no state has an estimate)."""
    wanted = {task_id for task_id, status in seen if status in ESTIMATED}
    found = await estimates(db, wanted, settings, within=within) if wanted else {}
    return [e if (e := found.get(task_id)) is not None and e.status is status else None for task_id, status in seen]
