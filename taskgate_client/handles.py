"""What the clients return for a task: every `Task` field, plus calls that follow, download and cancel it.

The handle is a `Task` subclass, so code that reads `task.task_id`, `task.status` or `task.result` keeps working;
`task.result` stays the field (where the output lives, its size and sha256), and `download(path)` fetches the bytes.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable, Generator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from taskgate_client.errors import TaskFailed
from taskgate_client.streaming import Output, Preview, TextDelta
from taskgate_client.types import Status, Task, TaskEvent, TaskResult

if TYPE_CHECKING:
    from taskgate_client.aio import AsyncTaskgateClient
    from taskgate_client.sync import TaskgateClient


def _fields(task: Task) -> dict[str, Any]:
    return {name: getattr(task, name) for name in Task.__dataclass_fields__}


@dataclass(frozen=True, slots=True)
class AsyncTaskHandle(Task):
    """A task from the asyncio client: the state it had when returned, and awaitable calls on it."""

    client: AsyncTaskgateClient = field(kw_only=True, repr=False, compare=False)

    @classmethod
    def bind(cls, task: Task, client: AsyncTaskgateClient) -> AsyncTaskHandle:
        """`task` with calls made through `client`."""
        return cls(**_fields(task), client=client)

    async def refresh(self) -> AsyncTaskHandle:
        """The task's current state."""
        return await self.client.get(self.task_id)

    async def wait(
        self, timeout: float | None = None, *, on_event: Callable[[TaskEvent], Any] | None = None
    ) -> AsyncTaskHandle:
        """The task once terminal (any terminal state; WaitTimeout after `timeout` seconds)."""
        return await self.client.wait(self.task_id, timeout, on_event=on_event)

    async def cancel(self, hard: bool = False) -> AsyncTaskHandle:
        """Cancels the task (soft by default: a running task finishes and its output is kept for reuse)."""
        return await self.client.cancel(self.task_id, hard)

    def events(self, *, after_version: int = 0) -> AsyncIterator[TaskEvent]:
        """The task's snapshot, then each later event until it is terminal (resumes dropped streams)."""
        return self.client.watch(self.task_id, after_version=after_version)

    def output(self, *, after_sequence: int = 0) -> AsyncIterator[Output]:
        """The task's partial output chunks (text, preview, log) in order until it ends (resumes dropped streams)."""
        return self.client.output(self.task_id, after_sequence=after_sequence)

    def previews(self, *, fetch: bool = True, after_sequence: int = 0) -> AsyncIterator[Preview]:
        """A running video's preview images as they are made (`async for p in handle.previews()`: p.step, p.data)."""
        return self.client.previews(self.task_id, fetch=fetch, after_sequence=after_sequence)

    def logs(self, *, after_sequence: int = 0) -> AsyncIterator[Output]:
        """The worker's log lines about the task as they come (each an Output of kind "log"), until it ends."""
        return self.client.logs(self.task_id, after_sequence=after_sequence)

    def stream_text(self) -> AsyncIterator[TextDelta]:
        """A chat task's text as it is generated, delta by delta (`async for delta in handle.stream_text()`)."""
        return self.client.stream_text(self.task_id)

    async def text(self, timeout: float | None = None) -> str:
        """A chat task's whole answer once it SUCCEEDED (TaskFailed if it ended otherwise)."""
        return await self.client.text(self.task_id, timeout)

    async def download(self, path: str | os.PathLike[str], *, timeout: float | None = None) -> TaskResult:
        """Waits for the task unless it finished, then writes its output to `path`, verified against its sha256.

        Raises TaskFailed when the task ended without a result, WaitTimeout when it is still running after `timeout`.
        """
        done = self if self.terminal else await self.wait(timeout)
        if done.status is not Status.SUCCEEDED:
            raise TaskFailed(done)
        return await self.client.download(self.task_id, path)


@dataclass(frozen=True, slots=True)
class TaskHandle(Task):
    """A task from the blocking client: the state it had when returned, and blocking calls on it."""

    client: TaskgateClient = field(kw_only=True, repr=False, compare=False)

    @classmethod
    def bind(cls, task: Task, client: TaskgateClient) -> TaskHandle:
        """`task` with calls made through `client`."""
        return cls(**_fields(task), client=client)

    def refresh(self) -> TaskHandle:
        """The task's current state."""
        return self.client.get(self.task_id)

    def wait(self, timeout: float | None = None, *, on_event: Callable[[TaskEvent], Any] | None = None) -> TaskHandle:
        """The task once terminal (any terminal state; WaitTimeout after `timeout` seconds)."""
        return self.client.wait(self.task_id, timeout, on_event=on_event)

    def cancel(self, hard: bool = False) -> TaskHandle:
        """Cancels the task (soft by default: a running task finishes and its output is kept for reuse)."""
        return self.client.cancel(self.task_id, hard)

    def events(self, *, after_version: int = 0) -> Generator[TaskEvent, None, None]:
        """The task's snapshot, then each later event until it is terminal (resumes dropped streams)."""
        return self.client.watch(self.task_id, after_version=after_version)

    def output(self, *, after_sequence: int = 0) -> Generator[Output, None, None]:
        """The task's partial output chunks (text, preview, log) in order until it ends (resumes dropped streams)."""
        return self.client.output(self.task_id, after_sequence=after_sequence)

    def previews(self, *, fetch: bool = True, after_sequence: int = 0) -> Generator[Preview, None, None]:
        """A running video's preview images as they are made (`for p in handle.previews()`: p.step, p.data)."""
        return self.client.previews(self.task_id, fetch=fetch, after_sequence=after_sequence)

    def logs(self, *, after_sequence: int = 0) -> Generator[Output, None, None]:
        """The worker's log lines about the task as they come (each an Output of kind "log"), until it ends."""
        return self.client.logs(self.task_id, after_sequence=after_sequence)

    def stream_text(self) -> Generator[TextDelta, None, None]:
        """A chat task's text as it is generated, delta by delta (`for delta in handle.stream_text()`)."""
        return self.client.stream_text(self.task_id)

    def text(self, timeout: float | None = None) -> str:
        """A chat task's whole answer once it SUCCEEDED (TaskFailed if it ended otherwise)."""
        return self.client.text(self.task_id, timeout)

    def download(self, path: str | os.PathLike[str], *, timeout: float | None = None) -> TaskResult:
        """Waits for the task unless it finished, then writes its output to `path`, verified against its sha256.

        Raises TaskFailed when the task ended without a result, WaitTimeout when it is still running after `timeout`.
        """
        done = self if self.terminal else self.wait(timeout)
        if done.status is not Status.SUCCEEDED:
            raise TaskFailed(done)
        return self.client.download(self.task_id, path)
