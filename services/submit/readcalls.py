"""The TaskGateway calls that read a tenant's tasks: GetTask (with its ETA and the suggested poll interval), ListTasks,
GetTaskResult (a result or a preview, in chunks)."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import AsyncIterator
from datetime import UTC, datetime

from google.protobuf.duration_pb2 import Duration

from taskgate import clienttokens, errors, eta, ids, output, paging
from taskgate.model import TaskRow
from taskgate.results import ResultNotFound, add_link
from taskgate.states import Status
from taskgate.store import submissions
from taskgate_api import reasons
from taskgate_api.v1 import gateway_pb2, task_pb2

from .core import Context, GatewayCore
from .validation import moment

log = logging.getLogger("taskgate.submit")


def poll_interval(created_at: datetime, now: datetime | None = None) -> float:
    """How long a client should wait before asking again: 2 s in a task's first 30 s, 5 s until 2 min, then 10 s."""
    age = ((now or datetime.now(UTC)) - created_at).total_seconds()
    if age < 30:
        return 2.0
    if age < 120:
        return 5.0
    return 10.0


class ReadCalls(GatewayCore):
    """The TaskGateway calls that read tasks (a mixin of Gateway)."""

    async def _estimate(self, task: TaskRow, context: Context) -> eta.Estimate | None:
        """A QUEUED or PROCESSING task's position and ETA from the process's queue snapshot; None for other states."""
        return await self._queue.estimate(task, within=self._budget(context))

    async def GetTask(self, request: gateway_pb2.GetTaskRequest, context: Context) -> gateway_pb2.GetTaskResponse:
        who = await self._caller(context, clienttokens.READ)
        task = await self._load(who, ids.require(request.task_id), context)
        estimate = await self._estimate(task, context)
        position = estimate.queue_position if estimate is not None else await self._queue_position(task, context)
        interval = Duration()
        interval.FromMilliseconds(int(poll_interval(task.created_at) * 1000))
        msg = task.to_proto(position)
        if estimate is not None:
            estimate.stamp(msg)
        add_link(self._results, msg.result)
        return gateway_pb2.GetTaskResponse(task=msg, suggested_poll_interval=interval)

    async def ListTasks(self, request: gateway_pb2.ListTasksRequest, context: Context) -> gateway_pb2.ListTasksResponse:
        who = await self._principal(context)
        bad: list[tuple[str, str]] = []
        size = request.page_size or self._settings.list_default_page_size
        if size < 0:
            bad.append(("page_size", "must not be negative"))
        size = min(max(size, 1), self._settings.list_max_page_size)
        statuses: set[Status] = set()
        for value in request.statuses:
            if value == task_pb2.TASK_STATUS_UNSPECIFIED or value not in task_pb2.TaskStatus.values():
                bad.append(("statuses", "each must be a known status"))
                break
            statuses.add(Status.from_proto(value))
        after = moment(request, "created_after", bad)
        before = moment(request, "created_before", bad)
        fingerprint = paging.filter_key(sorted(s.value for s in statuses), after, before)
        cursor = None
        if request.page_token:
            try:
                cursor = self._pages.decode(request.page_token, fingerprint)
            except paging.BadToken as exc:
                bad.append(("page_token", str(exc)))
        if bad:
            raise errors.invalid_argument(bad)
        rows = await submissions.list_tasks(
            self._pool,
            who.tenant_id,
            statuses=statuses,
            created_after=after,
            created_before=before,
            after=cursor,
            limit=size + 1,
            within=self._budget(context),
        )
        tasks = rows[:size]
        token = ""
        if len(rows) > size:
            last = tasks[-1]
            token = self._pages.encode(paging.Cursor(last.created_at, last.id), fingerprint)
        listed = [t.to_proto() for t in tasks]
        for msg in listed:  # a page of chat answers could pass the message limit: GetTask has each one's
            if msg.HasField("text"):
                msg.text.text, msg.text.truncated = "", msg.text.chars > 0
        return gateway_pb2.ListTasksResponse(tasks=listed, next_page_token=token)

    async def GetTaskResult(
        self, request: gateway_pb2.GetTaskResultRequest, context: Context
    ) -> AsyncIterator[gateway_pb2.ResultChunk]:
        who = await self._caller(context, clienttokens.READ)
        task = await self._load(who, ids.require(request.task_id), context)
        if request.preview_uri:
            async for chunk in self._preview(task, request.preview_uri):
                yield chunk
            return
        if task.status is not Status.SUCCEEDED or task.result_uri is None:
            raise errors.failed_precondition(
                reasons.TASK_NOT_SUCCEEDED, f"the task is {task.status.value}; only SUCCEEDED tasks have a result",
                status=task.status.value,
            )
        if task.result_expired_at is not None:
            raise errors.not_found("result")  # deleted by retention
        info = task_pb2.TaskResult(
            uri=task.result_uri,
            content_type=task.result_content_type or "",
            size_bytes=task.result_size or 0,
            sha256=task.result_sha256 or "",
        )
        offset = 0
        try:
            async for data in self._results.read(task.result_uri):
                chunk = gateway_pb2.ResultChunk(data=data, offset=offset)
                if offset == 0:
                    chunk.info.CopyFrom(info)
                yield chunk
                offset += len(data)
        except ResultNotFound:
            log.warning("result missing from the store", extra={"task_id": str(task.id)})
            raise errors.not_found("result") from None
        if offset == 0:
            yield gateway_pb2.ResultChunk(info=info, data=b"", offset=0)

    async def _preview(self, task: TaskRow, uri: str) -> AsyncIterator[gateway_pb2.ResultChunk]:
        """One of the task's preview images (services/worker/partial.py names them), in chunks."""
        if not output.is_preview_of(self._results, task.id, uri):
            raise errors.not_found("preview")
        info = task_pb2.TaskResult(uri=uri, content_type=output.preview_type(uri))
        try:
            data = b"".join([part async for part in self._results.read(uri)])
        except ResultNotFound:
            raise errors.not_found("preview") from None
        info.size_bytes = len(data)
        info.sha256 = hashlib.sha256(data).hexdigest()
        for offset in range(0, max(1, len(data)), _PREVIEW_CHUNK):
            chunk = gateway_pb2.ResultChunk(data=data[offset : offset + _PREVIEW_CHUNK], offset=offset)
            if offset == 0:
                chunk.info.CopyFrom(info)
            yield chunk


_PREVIEW_CHUNK = 256 * 1024

