"""The asyncio client's calls that follow tasks as they change: one task's events, its partial output (text, previews,
log lines), every task's events, and waiting for a task to end."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from taskgate_api import _compat as compat
from taskgate_api.v1 import events_pb2, gateway_pb2
from taskgate_client.channels import ClientCore
from taskgate_client.errors import NotFound, TaskFailed, TaskgateError, WaitTimeout, from_rpc_error
from taskgate_client.handles import AsyncTaskHandle
from taskgate_client.messages import StatusFilter, wire_statuses
from taskgate_client.resume import AsyncEventStream, Resumer
from taskgate_client.streaming import Output, Preview, TextAssembler, TextDelta
from taskgate_client.types import Status, TaskEvent

# When the event stream itself cannot be used, wait() polls instead.
POLL_INSTEAD = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.DEADLINE_EXCEEDED}
)


class FollowCalls(ClientCore):
    """Following tasks: watch, output, stream_text, previews, logs, text, watch_all, wait."""

    async def watch(
        self, task_id: str, *, after_version: int = 0, resume_attempts: int | None = None
    ) -> AsyncIterator[TaskEvent]:
        """The task's snapshot, then each later event, until it is terminal.

        A dropped stream (UNAVAILABLE, ABORTED, ...) is resumed with the last version seen, so no event is
        skipped or repeated; after `resume_attempts` failures in a row the last error is raised.
        """
        last = after_version
        limit = self.config.watch_resume_attempts if resume_attempts is None else resume_attempts
        resume = Resumer(limit, self.config.retry_max_delay, "event stream keeps ending early")
        while True:
            call = self._events.WatchTask(
                events_pb2.WatchTaskRequest(task_id=task_id, after_version=last), metadata=self.metadata
            )
            with resume.following(call):
                async for msg in call:
                    kind = msg.WhichOneof("kind")
                    if kind == "snapshot":
                        event = TaskEvent.from_snapshot(msg.snapshot)
                    elif kind == "event":
                        event = TaskEvent.from_proto(msg.event)
                    else:
                        continue
                    if event.version <= last:
                        continue
                    last = event.version
                    resume.progressed()
                    yield event
                    if event.terminal:
                        return
            if resume.error is None:
                # The server ended the stream without a terminal event: maybe we resumed after the end.
                task = await self.get(task_id)
                if task.terminal:
                    if task.version > last:
                        yield TaskEvent.from_snapshot(task.proto)
                    return
            await resume.pause()

    async def output(
        self, task_id: str, *, after_sequence: int = 0, resume_attempts: int | None = None
    ) -> AsyncIterator[Output]:
        """The task's partial output (text deltas, previews, log lines) from `after_sequence` on, in order, until the
        task is terminal (its chunks stored before that all come first).

        A dropped stream is resumed from the last version and the last chunk's sequence, so no chunk is skipped or
        repeated; after `resume_attempts` failures in a row the last error is raised.
        """
        version, sequence = 0, after_sequence
        limit = self.config.watch_resume_attempts if resume_attempts is None else resume_attempts
        resume = Resumer(limit, self.config.retry_max_delay, "output stream keeps ending early")
        while True:
            request = events_pb2.WatchTaskRequest(
                task_id=task_id, after_version=version, include_output=True, after_output_sequence=sequence
            )
            call = self._events.WatchTask(request, metadata=self.metadata)
            ended = False
            with resume.following(call):
                async for msg in call:
                    kind = msg.WhichOneof("kind")
                    if kind == "output":
                        if msg.output.sequence <= sequence:
                            continue
                        sequence = msg.output.sequence
                        resume.progressed()
                        yield Output.from_proto(msg.output)
                    elif kind == "snapshot":
                        version = max(version, msg.snapshot.version)
                        ended = Status.from_proto(msg.snapshot.status).terminal
                    elif kind == "event":
                        version = max(version, msg.event.version)
                        ended = Status.from_proto(msg.event.to_status).terminal
                if ended:
                    return  # the server ended the stream after the terminal state: the output is complete
            if resume.error is None and (await self.get(task_id)).terminal:
                return  # resumed after the end: the server sent what was left of the output, then ended
            await resume.pause()

    async def stream_text(self, task_id: str, *, resume_attempts: int | None = None) -> AsyncIterator[TextDelta]:
        """The task's text as it is generated, one delta (a `str`) at a time, until the task ends; a delta with
        `restarted` set begins a newer attempt's text at its `offset` (see TextDelta)."""
        text = TextAssembler()
        async for chunk in self.output(task_id, resume_attempts=resume_attempts):
            if (delta := text.feed(chunk)) is not None:
                yield delta

    async def previews(
        self, task_id: str, *, fetch: bool = True, after_sequence: int = 0, resume_attempts: int | None = None
    ) -> AsyncIterator[Preview]:
        """The preview images of a running video as they are made, in order, until the task ends; each with its bytes
        when `fetch` (None for one already deleted), else only where it is (`preview_bytes` reads it)."""
        async for chunk in self.output(task_id, after_sequence=after_sequence, resume_attempts=resume_attempts):
            if chunk.kind != "preview":
                continue
            data = None
            if fetch:
                with contextlib.suppress(NotFound):  # deleted since (retention): the reference still says what it was
                    data = await self.preview_bytes(task_id, chunk.uri)
            yield Preview.of(chunk, data)

    async def preview_bytes(self, task_id: str, uri: str) -> bytes:
        """One preview image of the task (a Preview's or a preview Output's `uri`), read through the gateway."""
        request = gateway_pb2.GetTaskResultRequest(task_id=task_id, preview_uri=uri)
        async for attempt in self._retrying():
            with attempt:
                data = bytearray()
                call = self._gateway.GetTaskResult(request, metadata=self.metadata)
                try:
                    async for chunk in call:
                        data += chunk.data
                except grpc.aio.AioRpcError as exc:
                    raise from_rpc_error(exc) from None
                return bytes(data)
        raise AssertionError("unreachable")  # pragma: no cover

    async def logs(
        self, task_id: str, *, after_sequence: int = 0, resume_attempts: int | None = None
    ) -> AsyncIterator[Output]:
        """The worker's log lines about the task (model load, warm-up, each phase's seconds) as they come, until it
        ends."""
        async for chunk in self.output(task_id, after_sequence=after_sequence, resume_attempts=resume_attempts):
            if chunk.kind == "log":
                yield chunk

    async def text(self, task_id: str, timeout: float | None = None) -> str:
        """A chat task's whole answer once it SUCCEEDED: inline from GetTask, else read with GetTaskResult.

        Raises TaskFailed when it ended otherwise, WaitTimeout when it is still running after `timeout`."""
        done = await self.wait(task_id, timeout)
        if done.status is not Status.SUCCEEDED:
            raise TaskFailed(done)
        if done.answer is not None and not done.answer.truncated:
            return done.answer.text
        data = bytearray()
        async for attempt in self._retrying():
            with attempt:
                data.clear()
                call = self._gateway.GetTaskResult(
                    gateway_pb2.GetTaskResultRequest(task_id=task_id), metadata=self.metadata
                )
                try:
                    async for chunk in call:
                        data += chunk.data
                except grpc.aio.AioRpcError as exc:
                    raise from_rpc_error(exc) from None
        return data.decode("utf-8", errors="replace")

    def watch_all(
        self, status: StatusFilter = None, *, cursor: str | None = None, resume_attempts: int | None = None
    ) -> AsyncEventStream:
        """Every event of the caller's tasks (into the `status` states; None: all) from `cursor` on (None: from now).

        The stream starts at its first iteration and never ends by itself. A dropped stream is resumed from the last
        cursor and skips what it already yielded; after `resume_attempts` failures in a row the last error is raised.
        A new stream from a saved cursor may repeat a few events from just before it (ids commit out of order).
        """
        statuses = wire_statuses(status)

        def open_stream(
            after: str,
        ) -> grpc.aio.UnaryStreamCall[events_pb2.WatchTasksRequest, events_pb2.WatchTasksResponse]:
            request = events_pb2.WatchTasksRequest(statuses=statuses, cursor=after)
            return self._events.WatchTasks(request, metadata=self.metadata)

        limit = self.config.watch_resume_attempts if resume_attempts is None else resume_attempts
        return AsyncEventStream(
            open_stream, cursor=cursor or "", resume_attempts=limit, max_delay=self.config.retry_max_delay
        )

    async def wait(
        self,
        task_id: str,
        timeout: float | None = None,
        *,
        on_event: Callable[[TaskEvent], Any] | None = None,
    ) -> AsyncTaskHandle:
        """Waits until the task is terminal and returns it: follows the event stream, or polls if it is unusable.

        Raises WaitTimeout after `timeout` seconds (None: no limit). `on_event` sees each event (or polled state).
        """
        try:
            async with compat.timeout(timeout):
                try:
                    async for event in self.watch(task_id, resume_attempts=2):
                        if on_event is not None:
                            on_event(event)
                        if event.terminal:
                            return await self.get(task_id)
                except TaskgateError as exc:
                    if exc.code not in POLL_INSTEAD:
                        raise
                return await self._poll(task_id, on_event)
        except TimeoutError:
            raise WaitTimeout(task_id, timeout or 0.0) from None

    async def _poll(self, task_id: str, on_event: Callable[[TaskEvent], Any] | None) -> AsyncTaskHandle:
        while True:
            task, interval = await self.get_with_interval(task_id)
            if on_event is not None:
                on_event(TaskEvent.from_snapshot(task.proto))
            if task.terminal:
                return self._handle(task)
            await asyncio.sleep(interval)
