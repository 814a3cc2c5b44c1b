"""The reads every stream of the process shares: Estimates (the ETA a live event carries, one read per task version).
(The newest thing each quiet stream could have missed is read by the keep-alive tick, subscriber.Keepalive.)"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict

import asyncpg

from taskgate import eta, store
from taskgate.config import NotifierSettings
from taskgate.queueview import QueueView
from taskgate.states import Status
from taskgate_api.v1 import task_pb2

log = logging.getLogger("taskgate.notifier.streams")


class Estimates:
    """The ETA that live events carry, read once per task version for every stream of this process: the versions asked
    for while a read runs go together in the next one, and each answer is kept KEEP_SECONDS for later readers. A read
    is the asked tasks' rows (one statement of primary-key reads) placed in the process's queue snapshot (`queue`),
    so it costs what was asked, never the backlog (the eta_inputs statement it replaced placed each task by counting
    its whole level: 10,000 streams' re-publish events on a 10,000-task backlog made one read of minutes)."""

    KEEP_SECONDS = 1.0
    KEPT = 10_000  # answers kept at most

    def __init__(self, pool: asyncpg.Pool, settings: NotifierSettings, queue: QueueView) -> None:
        self._pool = pool
        self._settings = settings
        self._queue = queue
        self._kept: OrderedDict[tuple[int, int], tuple[float, asyncio.Future[eta.Estimate | None]]] = OrderedDict()
        self._asked: dict[tuple[int, int], tuple[Status, asyncio.Future[eta.Estimate | None]]] = {}
        self._reader: asyncio.Task[None] | None = None

    async def estimate(self, task_id: int, version: int, status: Status) -> eta.Estimate | None:
        """eta.current of the task seen at `version` in `status`, shared by every stream that asks for that version."""
        if status not in eta.ESTIMATED:
            return None
        key = (task_id, version)
        now = time.monotonic()
        kept = self._kept.get(key)
        if kept is None or kept[0] < now:
            answer: asyncio.Future[eta.Estimate | None] = asyncio.get_running_loop().create_future()
            self._kept[key] = (now + self.KEEP_SECONDS, answer)
            self._kept.move_to_end(key)
            while len(self._kept) > self.KEPT:
                self._kept.popitem(last=False)
            self._asked[key] = (status, answer)
            if self._reader is None or self._reader.done():
                self._reader = asyncio.create_task(self._read(), name="notifier-eta")
        else:
            answer = kept[1]
        return await asyncio.shield(answer)  # a stream that ends while waiting must not cancel the others' answer

    async def stamped(self, event: task_pb2.TaskEvent) -> task_pb2.TaskEvent:
        """The event into QUEUED or PROCESSING with the task's ETA, while the task is still in that state."""
        found = await self.estimate(int(event.task_id), event.version, Status.from_proto(event.to_status))
        if found is None:
            return event
        out = task_pb2.TaskEvent()
        out.CopyFrom(event)  # a live event is shared by every stream of the task: stamp a copy
        found.stamp(out)
        return out

    async def _read(self) -> None:
        while self._asked:
            asked, self._asked = self._asked, {}
            keys = list(asked)
            found: list[eta.Estimate | None] = [None] * len(keys)
            try:
                found = await self._read_many([(t, asked[(t, v)][0]) for t, v in keys])
            except Exception:
                log.warning("ETA read failed; events go without one", exc_info=True)
                for key in keys:
                    self._kept.pop(key, None)  # not kept: the next reader asks again
            finally:  # answered even when cancelled: no stream waits on a read that will never end
                for key, estimate in zip(keys, found, strict=True):
                    answer = asked[key][1]
                    if not answer.done():
                        answer.set_result(estimate)


    async def _read_many(self, seen: list[tuple[int, Status]]) -> list[eta.Estimate | None]:
        """The estimates of the tasks seen (id, status), in order, each while the task is still in that status."""
        within = self._settings.submit_db_timeout_seconds
        rows = await store.get_tasks(self._pool, [task_id for task_id, _ in seen])
        out: list[eta.Estimate | None] = []
        for task_id, status in seen:
            row = rows.get(task_id)
            out.append(
                await self._queue.estimate(row, within=within) if row is not None and row.status is status else None
            )
        return out
