"""A live progress line for one task: queue position while QUEUED, denoising progress while PROCESSING, and the ETA
the server gives (when it has recent history to give one)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from datetime import datetime
from typing import TextIO

from taskgate_api._compat import UTC
from taskgate_client.aio import AsyncTaskgateClient
from taskgate_client.types import Status, Task, TaskEvent

WAITING = frozenset({Status.CREATED, Status.QUEUED})
ETA_SHOWN = frozenset({Status.QUEUED, Status.PROCESSING})


def _eta(when: datetime) -> str:
    """'in ~40s', 'in ~3m', 'in ~1h05m' (coarse, so a line that is not redrawn changes only when the estimate does)."""
    seconds = max((when - datetime.now(UTC)).total_seconds(), 0.0)
    if seconds < 60:
        return f"in ~{max(round(seconds / 5) * 5, 5)}s"
    if seconds < 3600:
        return f"in ~{round(seconds / 60)}m"
    hours, minutes = divmod(round(seconds / 60), 60)
    return f"in ~{hours}h{minutes:02d}m"


class ProgressBar:
    """Redraws one line on a terminal; elsewhere prints a line only when something changed."""

    def __init__(self, out: TextIO, *, width: int = 28, tty: bool | None = None) -> None:
        self.out = out
        self.width = width
        self.tty = out.isatty() if tty is None else tty
        self.status: Status | None = None
        self.version = 0
        self.progress = 0
        self.queue_position = 0
        self.estimated_start: datetime | None = None
        self.estimated_finish: datetime | None = None
        self._started = time.monotonic()
        self._last_line = ""

    def event(self, event: TaskEvent) -> None:
        """Takes a watched event (or a polled snapshot) if it is newer than what is shown."""
        if event.version < self.version:
            return
        same = event.status == self.status
        position = event.queue_position if event.snapshot else (self.queue_position if same else 0)
        # an event without an ETA keeps the last one
        if event.snapshot or event.estimated_finish is not None or not same:
            self.estimated_start, self.estimated_finish = event.estimated_start, event.estimated_finish
        self.update(event.status, event.progress, position, event.version)

    def queue(self, task: Task) -> None:
        """Refreshes the queue position and the ETA from a polled task of the same version."""
        if task.version == self.version and task.status in WAITING:
            self.estimated_start, self.estimated_finish = task.estimated_start, task.estimated_finish
            self.update(task.status, task.progress, task.queue_position, task.version)

    def update(self, status: Status, progress: int, queue_position: int, version: int) -> None:
        self.status, self.progress, self.queue_position, self.version = status, progress, queue_position, version
        self._draw(final=False)

    def finish(self, task: Task) -> None:
        """Draws the final state and ends the line."""
        self.status, self.progress, self.version = task.status, task.progress, task.version
        if task.status is Status.SUCCEEDED:
            self.progress = 100
        self._draw(final=True)

    def _line(self) -> str:
        status = self.status.value if self.status else "…"
        filled = round(self.width * self.progress / 100)
        bar = "█" * filled + "░" * (self.width - filled)
        if self.status in WAITING:
            detail = f"queue position {self.queue_position}" if self.queue_position else "waiting for a worker"
            if self.estimated_start is not None:
                detail += f", starts {_eta(self.estimated_start)}"
        else:
            detail = f"{self.progress:3d}%"
        if self.estimated_finish is not None and self.status in ETA_SHOWN:
            detail += f", done {_eta(self.estimated_finish)}"
        return f"{status:<10} [{bar}] {detail}"

    def _draw(self, *, final: bool) -> None:
        line = self._line()
        elapsed = f"{time.monotonic() - self._started:5.1f}s"
        if self.tty:
            self.out.write(f"\r\x1b[2K{line}  {elapsed}" + ("\n" if final else ""))
        elif line != self._last_line:
            self.out.write(f"{line}  {elapsed}\n")
        self._last_line = line
        self.out.flush()


async def follow(client: AsyncTaskgateClient, task_id: str, out: TextIO, wait_seconds: float | None = None) -> Task:
    """Shows a task's progress on `out` until it is terminal, and returns the final task."""
    bar = ProgressBar(out)

    async def refresh_queue_position() -> None:
        # Events do not carry the queue position; poll it while the task waits.
        while True:
            await asyncio.sleep(1.0)
            if bar.status in WAITING:
                with contextlib.suppress(Exception):
                    bar.queue(await client.get(task_id))

    refresher = asyncio.create_task(refresh_queue_position())
    try:
        task = await client.wait(task_id, wait_seconds, on_event=bar.event)
    finally:
        refresher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await refresher
    bar.finish(task)
    return task
