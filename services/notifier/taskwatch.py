"""One WatchTask stream's state between its items (TaskWatch): what it sent, where it resumes, the task's state as it
last sent it and the live progress it follows; and the keep-alive every WatchTask stream sends, serialized once."""

from __future__ import annotations

from collections.abc import AsyncIterator

from taskgate import errors
from taskgate.states import Status
from taskgate.wire import events as event_wire
from taskgate_api.v1 import events_pb2, task_pb2

from .output_feed import OutputHub
from .progress_feed import ProgressHub
from .subscriber import Closing, Overflow, Subscriber, ended

# the same bytes for every stream and every period: no message built or serialized per keep-alive (taskgate.server
# sends a streamed item that is bytes as it is)
KEEPALIVE = events_pb2.WatchTaskResponse(keepalive=events_pb2.KeepAlive()).SerializeToString()


class TaskWatch:
    """A WatchTask stream's state: one object with slots, where four closures and their cells were (~1.2 KiB of each
    of 10,000 idle streams)."""

    __slots__ = (
        "attempt", "following", "last", "outputs", "owner", "progress", "sent", "shown", "status", "sub", "task_id",
        "tenant",
    )

    def __init__(
        self,
        sub: Subscriber,
        task_id: int,
        tenant: str,
        outputs: OutputHub | None,
        progress: ProgressHub | None,
        sent: int,
    ) -> None:
        self.sub = sub
        self.task_id = task_id
        self.tenant = tenant
        self.outputs = outputs  # None: no output is sent
        self.progress = progress  # None: no live progress is sent
        self.sent = sent  # the last output chunk sent (its stream sequence)
        self.last = 0  # the last version sent
        self.status = Status.CREATED  # the state last sent (the row's, until an event is)
        self.owner = ""  # the task's tenant, which its live progress is published under
        self.attempt = 0
        self.shown = (0, 0)  # the live progress sent last: (percent, step)
        self.following = False  # whether this stream follows the task's live progress (while it is PROCESSING)

    def moved(self, now: Status, at_attempt: int, percent: int) -> None:
        """The stream sent a state: its live progress is followed while that is PROCESSING."""
        if at_attempt != self.attempt:
            self.attempt, self.shown = at_attempt, (0, 0)
        self.status, self.shown = now, (max(self.shown[0], percent), self.shown[1])
        if self.progress is None or (now is Status.PROCESSING) == self.following:
            return
        self.following = not self.following
        if self.following:
            self.progress.follow(self.owner, self.task_id, self.sub)
        else:
            self.progress.unfollow(self.task_id, self.sub)

    def newer_progress(self, live: task_pb2.TaskProgress) -> bool:
        """Whether a live progress is newer than what was sent, of the attempt that runs (then it is what was sent)."""
        if self.status is not Status.PROCESSING or live.attempt != self.attempt:
            return False
        if (live.progress, live.step) <= self.shown:
            return False
        self.shown = (live.progress, live.step)
        return True

    async def stored(self, final: bool = False) -> AsyncIterator[events_pb2.WatchTaskResponse]:
        """The task's stored output after the last chunk sent (`final`: all of it, read from the leader)."""
        if self.outputs is None:
            return
        while (chunk := await self.outputs.read_after(self.tenant, self.task_id, self.sent, final=final)) is not None:
            self.sent = chunk.sequence
            yield events_pb2.WatchTaskResponse(output=chunk)

    async def before_end(self, event: task_pb2.TaskEvent) -> AsyncIterator[events_pb2.WatchTaskResponse]:
        """A terminal event comes after the output stored before it; any event after a chunk's catch-up."""
        if event_wire.is_terminal(event):
            async for out in self.stored(final=True):
                yield out

    def ended(self, exc: Overflow | Closing) -> errors.ApiError:
        """The status the stream ends with when the server ends it, saying where it resumes (the request fields, and
        the same as the status's metadata)."""
        if self.outputs is None:
            return ended(exc, f"after_version={self.last}", last_version=str(self.last))
        return ended(
            exc,
            f"after_version={self.last} and after_output_sequence={self.sent}",
            last_version=str(self.last),
            last_output_sequence=str(self.sent),
        )

    def unfollow(self) -> None:
        """The stream ended: its task's output and live progress are no longer sent to it."""
        if self.outputs is not None:
            self.outputs.unfollow(self.tenant, self.task_id, self.sub)
        if self.progress is not None:
            self.progress.unfollow(self.task_id, self.sub)
