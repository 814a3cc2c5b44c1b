"""Retention: how long each kind of row is kept (Retention, from the retain_* settings), and the scan that deletes what
outlived it (RetentionScan: finished tasks, events, stored outputs, reusable outputs, input images, checkpoints),
which TaskAdmin's PurgeTasks also runs with the operator's own retention."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime
from typing import ClassVar

from services.scheduler.scans import Action, ScanContext, ScanResult
from taskgate import results
from taskgate.config import SchedulerSettings
from taskgate.store import maintenance

log = logging.getLogger("taskgate.scheduler")


@dataclass(frozen=True, slots=True)
class Retention:
    """How long each kind of row is kept, in seconds; None keeps it forever."""

    tasks: float | None = None
    events: float | None = None
    results: float | None = None
    reusable: float | None = None
    inputs: float | None = None

    @classmethod
    def of(cls, settings: SchedulerSettings) -> Retention:
        """The configured retention (a setting of 0 keeps forever)."""
        return cls(
            settings.retain_tasks_seconds or None, settings.retain_events_seconds or None,
            settings.retain_results_seconds or None, settings.retain_reusable_seconds or None,
            settings.retain_inputs_seconds or None,
        )


class RetentionScan:
    """Deletes what outlived its retention: finished tasks (with their history), events and webhook logs of finished
    tasks, stored outputs, reusable outputs, input images, each a bounded, skip-locked batch per pass in its own
    transaction.

    An output goes from the result store inside the transaction that forgets it, so a failed delete leaves the row
    for the next pass; an output shared by identical requests goes with the last row referring to it.
    """

    name: ClassVar[str] = "retention"

    def __init__(self, ctx: ScanContext) -> None:
        self.ctx = ctx
        self.outputs = results.result_store(ctx.settings, ctx.bus)

    async def run(self, now: datetime | None = None) -> ScanResult:
        return await self.purge(Retention.of(self.ctx.settings), now=now, limit=self.ctx.settings.scan_batch_size)

    async def _delete_outputs(self, uris: list[str]) -> int:
        deleted = 0
        for uri in uris:
            try:
                await self.outputs.delete(uri)
                deleted += 1
            except results.ResultNotFound:  # an output of another store (from before a switch): only its row goes
                log.warning("output of another result store left in place", extra={"uri": uri})
        return deleted

    async def purge(self, keep: Retention, *, now: datetime | None = None, limit: int) -> ScanResult:
        """One batch of each kind past `keep`; `examined` is the largest batch (a full one means more are due)."""
        result = ScanResult()
        batches: list[int] = []
        pool = self.ctx.pool
        # a checkpoint is of no use once its task has ended, whatever the retention: no age
        async with pool.acquire() as conn, conn.transaction():
            checkpoints = await maintenance.purge_checkpoints(conn, limit=limit)
            result.actions[Action.PURGE_CHECKPOINT] += await self._delete_outputs(checkpoints)
        batches.append(len(checkpoints))
        if keep.tasks is not None:
            async with pool.acquire() as conn, conn.transaction():
                gone = await maintenance.purge_tasks(conn, now=now, older_than_seconds=keep.tasks, limit=limit)
                result.actions[Action.PURGE_RESULT] += await self._delete_outputs(gone.orphans)
            result.actions[Action.PURGE_TASK] += gone.rows
            batches.append(gone.rows)
        if keep.results is not None:
            async with pool.acquire() as conn, conn.transaction():
                expired = await maintenance.purge_results(conn, now=now, older_than_seconds=keep.results, limit=limit)
                result.actions[Action.PURGE_RESULT] += await self._delete_outputs(expired.orphans)
            batches.append(expired.rows)
            async with pool.acquire() as conn, conn.transaction():  # previews go with the outputs, whatever the outcome
                previews = await maintenance.purge_previews(conn, now=now, older_than_seconds=keep.results, limit=limit)
                result.actions[Action.PURGE_RESULT] += await self._delete_outputs(previews)
            batches.append(len(previews))
        for seconds, purge, action in (
            (keep.reusable, maintenance.purge_reusable, Action.PURGE_REUSABLE),
            (keep.inputs, maintenance.purge_inputs, Action.PURGE_INPUT),
        ):
            if seconds is None:
                continue
            async with pool.acquire() as conn, conn.transaction():
                gone = await purge(conn, now=now, older_than_seconds=seconds, limit=limit)
                result.actions[Action.PURGE_RESULT] += await self._delete_outputs(gone.orphans)
            result.actions[action] += gone.rows
            batches.append(gone.rows)
        if keep.events is not None:
            events = await maintenance.purge_events(pool, now=now, older_than_seconds=keep.events, limit=limit)
            result.actions[Action.PURGE_EVENT] += events
            batches.append(events)
        result.examined = max(batches, default=0)
        if any(result.actions.values()):
            log.info("retention purge", extra={"purged": {a.value: n for a, n in result.actions.items() if n}})
        return result
