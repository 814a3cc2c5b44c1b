"""A running task's progress, live: each step goes to the notifiers on core NATS (taskgate.wire.progress), never to
PostgreSQL (the heartbeat writes the newest every progress_interval_seconds, lease.py)."""

from __future__ import annotations

import asyncio

from services.worker.run import Run
from taskgate import bus as busmod
from taskgate.wire import progress as progress_wire


class LiveProgress:
    """Publishes each run's newest step: the steps that come while a publish is under way go as their newest one."""

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
            for task_id, run in due.items():
                if run.finishing or run.stopped_by is not None or not run.total_steps or run.published_step == run.steps_done:
                    continue
                run.published_step = run.steps_done
                message = progress_wire.message(task_id, run.attempt, run.percent, run.steps_done, run.total_steps)
                await progress_wire.publish(self._bus, run.task.user_id, message)
