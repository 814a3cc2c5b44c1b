"""A process's shared view of the queue: every poll of a QUEUED or PROCESSING task reads its position and ETA from it.

A GetTask of a queued task used to compute its place with a statement that counted the task's level, its model's
levels and its tenant's tasks ahead (and a claim-by-claim simulation): a poll cost what the backlog was. Here the due
queue is read once per `eta_snapshot_seconds` for the whole process (`store.estimates.queue_snapshot`: each level's
tenants with their passes, weights and their due tasks' keys in claim order; the live workers' slots), and a poll
places its task in that snapshot with a binary search and a sum over its level's tenants — the same formula as the
`eta_inputs` block (fair share inside the level, the model's levels by the fetch weights, slots shared among models).
The run-time history a task's size class has is a bounded read, kept and refreshed as a snapshot is. So a poll is
the task's row (one primary-key read, or the terminal cache) and a few lookups in memory.

A snapshot older than the period is answered from while the next is read in the background, up to three periods;
beyond that (or with none yet) the poll waits for the read in flight. A period of 0 reads the queue for every poll
(polls arriving together still share one read).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from array import array
from bisect import bisect_left, bisect_right
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from fractions import Fraction
from typing import Any

import asyncpg

from taskgate import chat
from taskgate.config import CommonSettings
from taskgate.eta import ESTIMATED, Estimate, estimate
from taskgate.model import TaskRow
from taskgate.states import Priority, Status
from taskgate.store import estimates as store
from taskgate.store.estimates import EtaInputs, QueueRows, RunHistory

log = logging.getLogger("taskgate.queueview")

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_STALE_PERIODS = 3  # a snapshot up to this many periods old still answers while the next is read


def size_class(payload: Mapping[str, Any]) -> int:
    """The SQL function task_size_class in Python: floor(log2(frames x width x height)), each 1 unless a JSON number,
    the product at least 1 (the history of one class says nothing about another)."""
    whole = 1
    for name in ("num_frames", "width", "height"):  # whole numbers (the usual payload): no fractions needed
        value = payload.get(name)
        if type(value) is int:
            whole *= value
        elif isinstance(value, float) or (isinstance(value, int) and not isinstance(value, bool)):
            break
    else:
        return whole.bit_length() - 1 if whole >= 1 else 0
    product = Fraction(1)
    for name in ("num_frames", "width", "height"):
        value = payload.get(name)
        if isinstance(value, int | float) and not isinstance(value, bool):
            product *= Fraction(value)
    if product < 1:
        return 0
    k = product.numerator.bit_length() - product.denominator.bit_length()
    while Fraction(2) ** k > product:
        k -= 1
    while Fraction(2) ** (k + 1) <= product:
        k += 1
    return k


def micros(at: datetime) -> int:
    """A timestamp as the snapshot keys it: whole microseconds since the epoch."""
    return (at - _EPOCH) // timedelta(microseconds=1)


@dataclass(slots=True)
class _User:
    """One end user of a tenant in one level: its pass from the tenant's end-user floor on, its due tasks' keys."""

    pass_: float
    at: array[int]
    ids: array[int]

    def rank(self, at: int, task_id: int) -> int:
        """How many of its due tasks come before the key (at, task_id)."""
        lo = bisect_left(self.at, at)
        hi = bisect_right(self.at, at, lo)
        return bisect_left(self.ids, task_id, lo, hi)


@dataclass(slots=True)
class _Tenant:
    """One tenant of one level: its pass from the level's floor on, its weight, its due tasks' keys in claim order,
    and (when more than one end user has tasks there) each end user's, who take turns inside the tenant's turns."""

    pass_: float
    weight: float
    at: array[int]
    ids: array[int]
    users: dict[str, _User] = field(default_factory=dict)
    user_floor: float = 0.0

    def turns(self, end_user: str, at: int, task_id: int) -> int:
        """How many of the tenant's turns come before the task's: its end user's tasks before it and the other end
        users' turns that come first (stride 1 each, as worker_claim serves them); the tenant's own order when one
        end user has all its tasks."""
        if not self.users:
            return self.rank(at, task_id)
        me = self.users.get(end_user)
        upto = (me.rank(at, task_id) if me is not None else 0) + 1
        turn = (me.pass_ if me is not None else self.user_floor) + upto - 1
        ahead = sum(
            min(len(other.at), max(0, math.floor(turn - other.pass_) + 1))
            for name, other in self.users.items() if name != end_user and other.at
        )
        return upto - 1 + ahead

    def rank(self, at: int, task_id: int) -> int:
        """How many of its due tasks come before the key (at, task_id)."""
        lo = bisect_left(self.at, at)
        hi = bisect_right(self.at, at, lo)
        return bisect_left(self.ids, task_id, lo, hi)


@dataclass(slots=True)
class _Level:
    floor: float = 0.0
    tenants: dict[str, _Tenant] = field(default_factory=dict)
    due: int = 0


class Snapshot:
    """The queue as one refresh read it (pure: every answer is computed in memory)."""

    def __init__(self, rows: QueueRows, weights: tuple[int, int, int], taken: float) -> None:
        self.now = rows.now
        self.taken = taken  # time.monotonic() when it was read
        self._weights = weights
        self._levels: dict[tuple[str, int], _Level] = {}
        for r in rows.tenants:
            level = self._levels.setdefault((r.model_id, r.priority), _Level(floor=r.floor or 0.0))
            tenant = _Tenant(
                max(r.pass_ if r.pass_ is not None else level.floor, level.floor), r.weight, array("q", r.at),
                array("q", r.ids), user_floor=r.end_user_floor,
            )
            if len(set(r.end_users)) > 1:  # its end users take turns inside its turns
                for at, task_id, name in zip(r.at, r.ids, r.end_users, strict=True):
                    user = tenant.users.get(name)
                    if user is None:
                        passed = r.end_user_passes.get(name, r.end_user_floor)
                        user = tenant.users[name] = _User(max(passed, r.end_user_floor), array("q"), array("q"))
                    user.at.append(at)
                    user.ids.append(task_id)
            level.tenants[r.user_id] = tenant
            level.due += len(r.at)
        self._workers = rows.workers
        self._slots: dict[str, float] = {}

    def weight(self, priority: int) -> int:
        """The workers' fetch weight of a priority (as the eta_inputs block maps it)."""
        return (
            self._weights[0]
            if priority == Priority.HIGH
            else self._weights[1]
            if priority == Priority.NORMAL
            else self._weights[2]
        )

    def queued(self, model_id: str) -> dict[int, int]:
        """The due QUEUED tasks of each of a model's levels."""
        return {
            p: (lv.due if (lv := self._levels.get((model_id, p))) else 0)
            for p in (Priority.HIGH, Priority.NORMAL, Priority.LOW)
        }

    def slots(self, model_id: str, joining: int | None = None) -> float:
        """The live workers' slots serving a model, each worker's slots shared among its models by the weights of
        their levels with due tasks; `joining`: a priority of the model counted as busy although empty when read."""
        found = self._slots.get(model_id) if joining is None else None
        if found is None:
            busy: dict[str, int] = {}
            for (model, priority), level in self._levels.items():
                if level.due or (model == model_id and priority == joining):
                    busy[model] = busy.get(model, 0) + self.weight(priority)
            if joining is not None and (model_id, joining) not in self._levels:
                busy[model_id] = busy.get(model_id, 0) + self.weight(joining)
            mine = busy.get(model_id, 0)
            found = 0.0
            for models, slots in self._workers:
                total = sum(busy.get(m, 0) for m in models)
                if model_id in models and total:
                    found += slots * mine / total
            if joining is None:
                self._slots[model_id] = found
        return found

    def level_position(self, task: TaskRow) -> int:
        """The claims the task's level makes up to and including it under fair share: its tenant's due tasks up to
        it, plus each other tenant's due tasks whose stride turn comes first (functions/worker_claim.sql)."""
        level = self._levels.get((task.model_id, task.priority)) or _Level()
        me = level.tenants.get(task.user_id)
        assert task.queued_at is not None
        # itself, due or not, seen or not; inside its tenant's turns, its end user's
        upto = (me.turns(task.end_user, micros(task.queued_at), task.id) if me is not None else 0) + 1
        my_pass, my_weight = (me.pass_, me.weight) if me is not None else (level.floor, 1.0)
        turn = my_pass + (upto - 1) / my_weight
        ahead = 0
        for user_id, other in level.tenants.items():
            if user_id != task.user_id and other.at:
                ahead += min(len(other.at), max(0, math.floor((turn - other.pass_) * other.weight) + 1))
        return upto + ahead

    def inputs(self, task: TaskRow, run: RunHistory, now: datetime) -> EtaInputs:
        """What taskgate.eta.estimate needs for a QUEUED task, from this snapshot and its class's run history."""
        queued = self.queued(task.model_id)
        # a level empty when read (its task came in since) still takes its weight's share of the slots
        slots = self.slots(task.model_id, None if queued[task.priority] else task.priority)
        return replace(
            history_inputs(task, run, now), level_position=self.level_position(task), slots=slots, queued=queued
        )


def history_inputs(task: TaskRow, run: RunHistory, now: datetime) -> EtaInputs:
    """A task's ETA inputs from its row and its class's run history alone (no place in the queue)."""
    p = task.request_payload
    return EtaInputs(
        task_id=task.id, status=task.status, version=task.version, progress=task.progress, model_id=task.model_id,
        level_position=0, run_seconds=run.run_seconds, runs=run.runs, slots=0.0, now=now, priority=task.priority,
        max_output_tokens=int(p.get("max_output_tokens", 0)) if task.task_type == chat.TASK_TYPE else None,
        token_seconds=run.token_seconds, mean_output_tokens=run.mean_output_tokens,
    )


class QueueView:
    """Position and ETA of a task row from the process's shared snapshot; one per process."""

    def __init__(self, pool: asyncpg.Pool, settings: CommonSettings) -> None:
        self._pool = pool
        self._settings = settings
        self._period = settings.eta_snapshot_seconds
        self._snapshot: Snapshot | None = None
        self._reading: asyncio.Task[Snapshot] | None = None
        self._runs: dict[tuple[str, str, int], _Runs] = {}
        self._offset = timedelta(0)  # the database's clock minus this process's, as of the latest read

    async def estimate(self, task: TaskRow, *, within: float | None = None) -> Estimate | None:
        """The task's position and ETA as of its row and the snapshot; None for a state without one. Answered without
        waiting (nor a timer) while the snapshot and the class's run history are young enough."""
        if task.status not in ESTIMATED:
            return None
        spec = self._settings.models.get(task.model_id)
        cap = spec.max_concurrency if spec else 0
        weights = self._settings.priority_weights
        run = self._run_history_now(task)
        snap = self._snapshot_now() if task.status is Status.QUEUED else None
        if isinstance(run, asyncio.Task) or isinstance(snap, asyncio.Task):
            async with asyncio.timeout(within):  # shielded: a caller that gives up must not cancel the others' read
                if isinstance(run, asyncio.Task):
                    run = await asyncio.shield(run)
                if isinstance(snap, asyncio.Task):
                    snap = await asyncio.shield(snap)
        if snap is None:  # PROCESSING
            return estimate(history_inputs(task, run, self._now()), cap=cap, weights=weights)
        return estimate(snap.inputs(task, run, self._now()), cap=cap, weights=weights)

    def _now(self) -> datetime:
        """The database's now (ETAs compare database time), from this process's clock and the latest offset."""
        return datetime.now(UTC) + self._offset

    async def _fresh(self) -> Snapshot:
        """A snapshot young enough to answer from (see the module's docstring)."""
        snap = self._snapshot_now()
        return await asyncio.shield(snap) if isinstance(snap, asyncio.Task) else snap

    def _snapshot_now(self) -> Snapshot | asyncio.Task[Snapshot]:
        """The snapshot to answer from, or the read to wait for (see the module's docstring)."""
        snap = self._snapshot
        age = time.monotonic() - snap.taken if snap is not None else 0.0
        if snap is not None and age <= self._period:
            return snap
        if self._reading is None or self._reading.done():
            self._reading = asyncio.create_task(self._read(), name="queue-snapshot")
            self._reading.add_done_callback(_log_failure)
        if snap is not None and age <= self._period * _STALE_PERIODS:
            return snap
        return self._reading

    async def _read(self) -> Snapshot:
        taken = time.monotonic()
        rows = await store.queue_snapshot(
            self._pool, alive_seconds=self._settings.lease_seconds, within=self._settings.submit_db_timeout_seconds
        )
        self._offset = rows.now - datetime.now(UTC)
        snap = Snapshot(rows, self._settings.priority_weights, taken)
        self._snapshot = snap
        return snap

    async def _run_history(self, task: TaskRow) -> RunHistory:
        """The run history of the task's model, type and size class (as the snapshot: read once per period, an older
        one answering while the next is read, up to three periods)."""
        run = self._run_history_now(task)
        return await asyncio.shield(run) if isinstance(run, asyncio.Task) else run

    def _run_history_now(self, task: TaskRow) -> RunHistory | asyncio.Task[RunHistory]:
        """The task's class's run history to answer from, or the read to wait for."""
        key = (task.model_id, task.task_type, size_class(task.request_payload))
        kept = self._runs.get(key)
        if kept is None:
            if len(self._runs) >= _MAX_CLASSES:
                self._runs.clear()  # that many classes seen: start over rather than grow without bound
            kept = self._runs[key] = _Runs()
        age = time.monotonic() - kept.taken
        if kept.value is not None and age <= self._period:
            return kept.value
        if kept.reading is None or kept.reading.done():
            kept.reading = asyncio.create_task(self._read_runs(key, kept), name="eta-run-history")
            kept.reading.add_done_callback(_log_failure)
        if kept.value is not None and age <= self._period * _STALE_PERIODS:
            return kept.value
        return kept.reading

    async def _read_runs(self, key: tuple[str, str, int], kept: _Runs) -> RunHistory:
        taken = time.monotonic()
        run = await store.run_history(
            self._pool, *key, window_seconds=self._settings.eta_history_seconds,
            max_runs=self._settings.eta_history_runs, within=self._settings.submit_db_timeout_seconds,
        )
        kept.value, kept.taken = run, taken
        return run


@dataclass(slots=True)
class _Runs:
    """One class's run history as last read (None: not yet), when that read began, and the read in flight."""

    value: RunHistory | None = None
    taken: float = 0.0
    reading: asyncio.Task[RunHistory] | None = None


_MAX_CLASSES = 10_000  # (model, task type, size class) run histories kept at most


def _log_failure(read: asyncio.Task[Any]) -> None:
    """Retrieves a shared read's failure (its waiters, if any, raise it too; a background refresh has none)."""
    if not read.cancelled() and (exc := read.exception()) is not None:
        log.warning("queue read failed", extra={"error": f"{type(exc).__name__}: {exc}"[:300]})
