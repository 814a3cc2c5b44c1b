"""The dispatcher: created tasks onto JetStream and into QUEUED, a pass at a time, off the submit answer's path.

A pass publishes its tasks with pipelined acks (one write; the message id `<task>.q0` makes a repeat harmless), then
moves the acknowledged ones CREATED -> QUEUED in one statement. The submit service hands every committed batch to its
process's Dispatcher at once (no round trip between the commit and the publish); the scheduler's CreatedScan runs the
very same pass over the CREATED tasks that nobody dispatched (a submit process that died between its commit and its
publish, a publish that failed). A task whose publish or move fails stays CREATED, which is safe: a worker may claim
a CREATED task, and the scan publishes it again under the same message id.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable, Sequence

from taskgate import telemetry
from taskgate.bus import Bus
from taskgate.model import TaskRow
from taskgate.passes import Passes
from taskgate.server import BACKEND_ERRORS
from taskgate.store import Conn, submissions
from taskgate.wire import dispatch

log = logging.getLogger("taskgate.dispatch")

PASS_ERRORS: tuple[type[BaseException], ...] = (TimeoutError, *BACKEND_ERRORS)


async def dispatch_pass(
    db: Conn, bus: Bus, tasks: Sequence[TaskRow], *, actor: str, reason: str, ack_timeout: float, within: float
) -> list[TaskRow]:
    """Publishes `tasks` (acks pipelined, `ack_timeout` for the whole pass), then one CREATED -> QUEUED move for those
    acknowledged; returns the tasks that moved, as they now are."""
    published = await dispatch.publish_many(
        bus, [(t, dispatch.Reason.SUBMITTED) for t in tasks], ack_timeout=ack_timeout
    )
    if len(published) < len(tasks):
        telemetry.DISPATCH_PUBLISH_FAILURES.inc(len(tasks) - len(published))
    if not published:
        return []
    return await submissions.queue_created(db, [t for t, _ in published], actor=actor, reason=reason, within=within)


class Dispatcher:
    """Dispatches handed-over tasks in passes: one pass in flight, the next one takes all that arrived meanwhile."""

    def __init__(
        self, pool: Conn, bus: Bus, *, actor: str, ack_timeout: float, db_timeout: float, max_batch: int
    ) -> None:
        self._pool = pool
        self._bus = bus
        self._actor = actor
        self._ack_timeout = ack_timeout
        self._db_timeout = db_timeout
        self._passes: Passes[TaskRow] = Passes(self._pass, max_batch=max_batch, name="dispatcher")

    def hand(self, tasks: Iterable[TaskRow]) -> None:
        """Takes committed CREATED tasks to dispatch; returns at once."""
        self._passes.add(tasks)

    async def _pass(self, batch: list[TaskRow]) -> None:
        try:
            await dispatch_pass(
                self._pool, self._bus, batch, actor=self._actor, reason="dispatched",
                ack_timeout=self._ack_timeout, within=self._db_timeout,
            )
        except PASS_ERRORS as exc:
            log.warning("dispatch pass failed; its tasks stay CREATED for the scheduler's scan",
                        extra={"tasks": len(batch), "error": type(exc).__name__})
        except Exception:  # never lose the loop to one bad pass; the scan repairs what it left
            log.exception("dispatch pass failed", extra={"tasks": len(batch)})

    async def close(self, grace: float) -> None:
        """Lets the passes still to run finish within `grace` seconds, then stops (what is left stays CREATED)."""
        runner = self._passes.runner
        if runner is None:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(runner), grace)
        if not runner.done():
            runner.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await runner
        self._passes.pending.clear()
