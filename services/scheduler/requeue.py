"""Operator requeues: one guarded move per unfinished task back to QUEUED, with its dispatch, never one broad UPDATE;
and replays: a FAILED or TIMEOUT task, which stays terminal, run again as a new task linked to it."""

from __future__ import annotations

import asyncio
import enum
import logging
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import asyncpg

from services.scheduler.scans import Action
from taskgate import bus as busmod
from taskgate import store, telemetry, tracing
from taskgate.dispatcher import PASS_ERRORS, dispatch_pass
from taskgate.model import TaskRow
from taskgate.states import Status
from taskgate.store import Conn, Move
from taskgate.store import admin as admin_store
from taskgate.store.submissions import NewTask
from taskgate.wire import dispatch
from taskgate.wire.dispatch import Reason

log = logging.getLogger("taskgate.scheduler")

# The move that puts a task of each unfinished state back in the queue, and the dispatch that goes with it.
REQUEUE_MOVES: dict[Status, store.Queue | store.Republish | store.Release] = {
    Status.CREATED: store.Queue(),
    Status.QUEUED: store.Republish(),
    Status.PROCESSING: store.Release(),
}
DISPATCH_REASONS = {Move.QUEUE: Reason.SUBMITTED, Move.REPUBLISH: Reason.REPUBLISHED, Move.RELEASE: Reason.RELEASED}
# Terminal states a replay may start again from (the task's run ended badly), and why the others never are.
REPLAYABLE = frozenset({Status.FAILED, Status.TIMEOUT})
NEVER_REPLAYED = {
    Status.SUCCEEDED: "a succeeded task is never replayed (regenerate it for another output)",
    Status.CANCELED: "a canceled task is never replayed (its tenant canceled it)",
}


class Outcome(enum.StrEnum):
    """RequeueItem.action values."""

    REQUEUED = "REQUEUED"
    WOULD_REQUEUE = "WOULD_REQUEUE"
    REPLAYED = "REPLAYED"
    WOULD_REPLAY = "WOULD_REPLAY"
    SKIPPED = "SKIPPED"


@dataclass(frozen=True, slots=True)
class Item:
    """What a requeue did (or would do) to one task."""

    task_id: int
    from_status: Status | None
    outcome: Outcome
    detail: str


@dataclass(frozen=True, slots=True)
class Decision:
    """The move a requeue would make on one task, or its replay as a new task (neither: skip it), and why."""

    task_id: int
    task: TaskRow | None
    change: store.Change | None
    detail: str
    replay: bool = False

    @property
    def planned(self) -> Outcome:
        """What a dry run reports for it."""
        if self.replay:
            return Outcome.WOULD_REPLAY
        return Outcome.WOULD_REQUEUE if self.change is not None else Outcome.SKIPPED


def decide(task_id: int, seen: admin_store.LeasedTask | None, *, replay_finished: bool) -> Decision:
    """Missing and live-leased tasks are skipped, and terminal ones too but for a FAILED or TIMEOUT task not yet
    replayed when replays are asked for; the others get their state's move back to QUEUED."""
    if seen is None:
        return Decision(task_id, None, None, "no such task")
    task = seen.task
    status = task.status.value
    if task.status in NEVER_REPLAYED:
        return Decision(task_id, task, None, f"{status} is terminal; {NEVER_REPLAYED[task.status]}")
    if task.status in REPLAYABLE:
        if seen.replayed_as is not None:
            return Decision(
                task_id, task, None,
                f"{status} and already replayed as task {seen.replayed_as}; replay that task if it failed too",
            )
        if not replay_finished:
            return Decision(
                task_id,
                task,
                None,
                f"{status} is terminal; pass replay_finished (--replay-finished) to replay it as a new task",
            )
        return Decision(task_id, task, None, "as a new task", replay=True)
    if task.status is Status.PROCESSING and seen.lease_live:
        return Decision(task_id, task, None, f"worker {task.worker_id} is alive and holds the lease")
    change = REQUEUE_MOVES[task.status]
    return Decision(task_id, task, change, f"{status} -> QUEUED ({change.move.name.lower()})")


def replay_of(source: TaskRow, new_id: int) -> NewTask:
    """The new task that replays `source`: its tenant and its request as stored (prompt, params with their seed, input
    image, priority, metadata, callback, max_retries), with an idempotency key of its own (a replay is a new task, not
    the same submission sent again) and this call's trace context."""
    return NewTask(
        id=new_id,
        user_id=source.user_id,
        idempotency_key=f"replay-{source.id}-{secrets.token_hex(8)}",
        key_derived=False,
        request_hash=source.request_hash,  # what determines the output: the same request
        task_type=source.task_type,
        model_id=source.model_id,
        prompt=source.prompt,
        payload=source.request_payload,
        metadata=source.metadata,
        priority=source.priority,
        max_retries=source.max_retries,
        callback_url=source.callback_url,
        callback_events=source.callback_events,
        trace_context=tracing.carrier(),
        max_queue_seconds=source.max_queue_seconds,  # its own TTL again, from now (its start_after has passed)
        end_user=source.end_user,
    )


def _item(d: Decision, outcome: Outcome, detail: str | None = None) -> Item:
    return Item(d.task_id, d.task.status if d.task else None, outcome, detail or d.detail)


class Requeuer:
    """Plans (dry run) or applies requeues and replays of one batch of task ids."""

    def __init__(self, pool: asyncpg.Pool, bus: busmod.Bus, *, ack_timeout: float, db_timeout: float) -> None:
        self.pool = pool
        self.bus = bus
        self.ack_timeout = ack_timeout  # a replay's dispatch: the submit dispatcher's publish timeout
        self.db_timeout = db_timeout  # and its CREATED -> QUEUED statement's

    async def plan(self, ids: list[int], *, replay_finished: bool = False) -> list[Item]:
        """What apply() would do, reading without locks and changing nothing."""
        found = await admin_store.peek_tasks(self.pool, ids)
        out = []
        for task_id in ids:
            d = decide(task_id, found.get(task_id), replay_finished=replay_finished)
            out.append(_item(d, d.planned))
        return out

    async def apply(
        self, ids: list[int], *, actor: str, reason: str, new_id: Callable[[], int] | None = None
    ) -> list[Item]:
        """Locks the batch, publishes each requeue's dispatch, then moves each task and inserts each replay (ids from
        `new_id`; None: no replays, FAILED and TIMEOUT tasks are skipped); a failed publish aborts the batch. The
        replays are dispatched once committed (a worker must find the row); one whose dispatch fails stays CREATED for
        the scheduler's CreatedScan, as a submission's does."""
        async with self.pool.acquire() as conn:
            async with conn.transaction():
                decisions = await self._decide_locked(conn, ids, replay_finished=new_id is not None)
                await self._publish_requeues(decisions)
                items = await self._move(conn, decisions, actor=actor, reason=reason)
                wanted = [d for d in decisions if d.replay and d.task is not None]
                made = await self._insert_replays(conn, wanted, new_id) if wanted and new_id is not None else {}
            queued = await self._dispatch(conn, list(made.values()), actor=actor, reason=reason) if made else set()
        for d in wanted:
            replay = made.get(d.task_id)
            if replay is None:
                items[d.task_id] = _item(d, Outcome.SKIPPED, "its replay's idempotency key was taken; try again")
                continue
            late = (
                ""
                if replay.id in queued
                else " (its dispatch did not queue it: the scheduler's scan does if still CREATED)"
            )
            items[d.task_id] = _item(d, Outcome.REPLAYED, f"as task {replay.id}{late}")
            log.info("task replayed", extra={"task_id": d.task_id, "replay": replay.id, "actor": actor})
        out = [items[d.task_id] for d in decisions]
        for outcome, action in ((Outcome.REQUEUED, Action.REQUEUE), (Outcome.REPLAYED, Action.REPLAY)):
            done = sum(1 for i in out if i.outcome is outcome)
            if done:
                telemetry.SCHEDULER_ACTIONS.labels(action.value).inc(done)
        return out

    async def _decide_locked(
        self, conn: asyncpg.Connection, ids: list[int], *, replay_finished: bool
    ) -> list[Decision]:
        """One decision per id, in order, on the rows locked for this transaction; a row someone else holds is busy."""
        locked = await admin_store.lock_tasks(conn, ids)
        missing = [i for i in ids if i not in locked]
        busy = await admin_store.peek_tasks(conn, missing) if missing else {}
        decisions: list[Decision] = []
        for task_id in ids:
            if task_id in busy:
                row = busy[task_id].task
                decisions.append(Decision(task_id, row, None, "busy: a scan or a worker holds the row; try again"))
            else:
                decisions.append(decide(task_id, locked.get(task_id), replay_finished=replay_finished))
        return decisions

    async def _publish_requeues(self, decisions: Sequence[Decision]) -> None:
        """Publishes the dispatch of every requeue move; raises the first failure (nothing of the batch moves then)."""
        results = await asyncio.gather(
            *(
                dispatch.publish(self.bus, d.task, DISPATCH_REASONS[d.change.move])
                for d in decisions
                if d.task is not None and d.change is not None
            ),
            return_exceptions=True,
        )
        for result in results:
            if isinstance(result, BaseException):
                raise result

    async def _move(self, conn: Conn, decisions: Sequence[Decision], *, actor: str, reason: str) -> dict[int, Item]:
        """Applies each requeue move (guarded by the version read); every other decision is a skip for now."""
        items: dict[int, Item] = {}
        for d in decisions:
            if d.change is None or d.task is None:
                items[d.task_id] = _item(d, Outcome.SKIPPED)
                continue
            out = await store.apply(
                conn, d.task_id, d.change, actor=actor, reason=reason, expected_version=d.task.version,
                sources=(d.task.status,),
            )
            if out.applied:
                items[d.task_id] = _item(d, Outcome.REQUEUED)
            else:
                rejection = out.rejection.value if out.rejection else "?"
                items[d.task_id] = _item(d, Outcome.SKIPPED, f"changed meanwhile ({rejection})")
        return items

    async def _insert_replays(
        self, conn: Conn, wanted: Sequence[Decision], new_id: Callable[[], int]
    ) -> dict[int, TaskRow]:
        """The replays of the locked sources, inserted with their links; by source id."""
        replays = [(replay_of(d.task, new_id()), d.task_id) for d in wanted if d.task is not None]
        return {
            row.replay_of: row for row in await admin_store.replay_tasks(conn, replays) if row.replay_of is not None
        }

    async def _dispatch(self, conn: Conn, tasks: list[TaskRow], *, actor: str, reason: str) -> set[int]:
        """The submit dispatcher's pass over the committed replays; the ids it moved to QUEUED."""
        try:
            moved = await dispatch_pass(
                conn, self.bus, tasks, actor=actor, reason=reason, ack_timeout=self.ack_timeout, within=self.db_timeout
            )
        except PASS_ERRORS as exc:
            log.warning("replay dispatch failed; its tasks stay CREATED for the scheduler's scan",
                        extra={"tasks": len(tasks), "error": type(exc).__name__})
            return set()
        return {t.id for t in moved}
