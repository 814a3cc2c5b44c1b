"""Running tasks' progress, live: their steps go to the notifiers on core NATS (taskgate.wire.progress), never to
PostgreSQL (the heartbeat writes the newest every progress_interval_seconds, lease.py).

Both halves coalesce, so a fleet of slots costs per tick, not per step: the device threads' steps reach the event loop
at most once per `live_progress_tick_seconds` (steps.StepInbox: one wake-up for all the slots' steps, the newest of each
run), and each pass of LiveProgress publishes one message per tenant with the newest step of each of its runs.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict

from services.worker.runstate import Run
from taskgate import bus as busmod
from taskgate.wire import progress as progress_wire
from taskgate_api.v1 import task_pb2


class LiveProgress:
    """Publishes each run's newest step: the steps that come while a pass is under way go in the next one, each
    pass one message per tenant."""

    def __init__(self, bus: busmod.Bus) -> None:
        self._bus = bus
        self._due: dict[int, Run] = {}  # by task id: runs with a step not yet published
        self._wake = asyncio.Event()

    def stepped(self, run: Run) -> None:
        """A run reached a new step (called on the event loop)."""
        self._due[run.task.id] = run
        self._wake.set()

    async def loop(self) -> None:
        """Publishes what is due until cancelled."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            due, self._due = self._due, {}
            at = progress_wire.now()  # one stamp for the pass: its items were all due at its start
            by_tenant: defaultdict[str, list[task_pb2.TaskProgress]] = defaultdict(list)
            for task_id, run in due.items():
                if (
                    run.finishing
                    or run.stopped_by is not None
                    or not run.total_steps
                    or run.published_step == run.steps_done
                ):
                    continue
                run.published_step = run.steps_done
                by_tenant[run.task.user_id].append(
                    progress_wire.message(task_id, run.attempt, run.percent, run.steps_done, run.total_steps, at))
            for user_id, items in by_tenant.items():
                await progress_wire.publish(self._bus, user_id, items)
