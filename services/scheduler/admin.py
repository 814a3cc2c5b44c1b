"""TaskAdmin: the operators' API (admin key required) — stats, listings, stuck tasks, requeues, dead letters."""

from __future__ import annotations

import base64
import binascii
from collections.abc import AsyncIterator, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import grpc
from google.protobuf.duration_pb2 import Duration

from services.scheduler.requeue import Item, Requeuer
from services.scheduler.scans import TaskScan
from taskgate import bus as busmod
from taskgate import callbacks, errors, sql, store
from taskgate.auth import Authenticator
from taskgate.config import Settings
from taskgate.model import TaskRow, timestamp
from taskgate.states import UNFINISHED, Status
from taskgate.v1 import admin_pb2, admin_pb2_grpc, task_pb2

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_CALLBACK = {
    "PENDING": task_pb2.CALLBACK_STATUS_PENDING,
    "DELIVERED": task_pb2.CALLBACK_STATUS_DELIVERED,
    "FAILED": task_pb2.CALLBACK_STATUS_FAILED,
}


def encode_cursor(at: datetime, task_id: int) -> str:
    """An opaque page token for a (timestamp, id) keyset position."""
    micros = (at - _EPOCH) // timedelta(microseconds=1)
    return base64.urlsafe_b64encode(f"{micros}:{task_id}".encode()).decode()


def decode_cursor(token: str, field: str = "page_token") -> tuple[datetime, int]:
    """The keyset position of a page token; INVALID_ARGUMENT when it is not one of ours."""
    try:
        micros, task_id = base64.urlsafe_b64decode(token.encode()).decode().split(":")
        return _EPOCH + timedelta(microseconds=int(micros)), int(task_id)
    except (ValueError, binascii.Error, UnicodeDecodeError):
        raise errors.invalid_argument([(field, "not a page token from this listing")]) from None


def parse_task_id(value: str, field: str = "task_id") -> int:
    """A decimal task id; INVALID_ARGUMENT otherwise."""
    try:
        task_id = int(value)
    except ValueError:
        raise errors.invalid_argument([(field, "must be a decimal task id")]) from None
    if not 0 < task_id < 2**63:
        raise errors.invalid_argument([(field, "must be a decimal task id")])
    return task_id


def _duration(seconds: float) -> Duration:
    d = Duration()
    d.FromNanoseconds(int(max(seconds, 0.0) * 1e9))
    return d


def _statuses(values: Sequence[int], field: str) -> list[Status]:
    try:
        return [Status.from_proto(v) for v in values]
    except ValueError:
        raise errors.invalid_argument([(field, "unknown or unspecified task status")]) from None


def _state_counts(rows: list[asyncpg.Record]) -> list[admin_pb2.StateCount]:
    return [admin_pb2.StateCount(model_id=r["model_id"], status=Status(r["status"]).to_proto(), count=r["n"]) for r in rows]


class TaskAdminService(admin_pb2_grpc.TaskAdminServicer):
    """The TaskAdmin servicer; every call needs an admin key."""

    def __init__(self, settings: Settings, pool: asyncpg.Pool, bus: busmod.Bus, task_scans: Sequence[TaskScan]) -> None:
        self.settings = settings
        self.pool = pool
        self.auth = Authenticator(pool, settings.api_key_pepper)
        self.task_scans = list(task_scans)
        self.requeuer = Requeuer(pool, bus)

    def _page_size(self, requested: int, field: str = "page_size") -> int:
        if requested < 0:
            raise errors.invalid_argument([(field, "must not be negative")])
        return min(requested or self.settings.admin_page_size, self.settings.admin_max_page_size)

    def _filter(self, f: admin_pb2.TaskFilter) -> tuple[list[Status], str | None, float | None]:
        older = f.older_than.ToTimedelta().total_seconds() if f.HasField("older_than") else None
        if older is not None and older < 0:
            raise errors.invalid_argument([("filter.older_than", "must not be negative")])
        return _statuses(f.statuses, "filter.statuses"), f.model_id or None, older

    async def GetStats(self, request: admin_pb2.GetStatsRequest, context: grpc.aio.ServicerContext) -> admin_pb2.GetStatsResponse:
        """Counts per state and model, the oldest QUEUED age, tasks per worker, webhook outcomes."""
        await self.auth.principal(context, admin=True)
        async with self.pool.acquire() as conn:
            counts = await conn.fetch(sql.query("admin_state_counts"))
            oldest = await conn.fetchval(sql.query("admin_oldest_queued_age"))
            workers = await conn.fetch(sql.query("admin_worker_stats"), self.settings.lease_seconds)
            callbacks = await conn.fetch(sql.query("admin_callback_counts"))
        response = admin_pb2.GetStatsResponse(
            counts=_state_counts(counts),
            callbacks=[
                admin_pb2.CallbackCount(status=_CALLBACK.get(r["status"], task_pb2.CALLBACK_STATUS_UNSPECIFIED), count=r["n"])
                for r in callbacks
            ],
        )
        if oldest is not None:
            response.oldest_queued_age.CopyFrom(_duration(oldest))
        for w in workers:
            stats = response.workers.add(worker_id=w["worker_id"], running=w["running"], slots=w["slots"], alive=w["alive"])
            if w["last_heartbeat"] is not None:
                stats.last_heartbeat.CopyFrom(timestamp(w["last_heartbeat"]))
        return response

    async def ListTasks(
        self, request: admin_pb2.AdminListTasksRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.AdminListTasksResponse:
        """Tasks by state, model and age (least recently updated first), a page at a time."""
        await self.auth.principal(context, admin=True)
        statuses, model_id, older = self._filter(request.filter)
        limit = self._page_size(request.page_size)
        after_at, after_id = decode_cursor(request.page_token) if request.page_token else (None, None)
        rows = await self.pool.fetch(
            sql.query("admin_list_tasks"), [s.value for s in statuses], model_id, older, after_at, after_id, limit + 1
        )
        tasks = [TaskRow.from_record(r) for r in rows[:limit]]
        token = encode_cursor(tasks[-1].updated_at, tasks[-1].id) if len(rows) > limit else ""
        return admin_pb2.AdminListTasksResponse(tasks=[t.to_proto() for t in tasks], next_page_token=token)

    async def ListStuckTasks(
        self, request: admin_pb2.ListStuckTasksRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.ListStuckTasksResponse:
        """What the scans would act on now, with why (the scans' own queries; rows a scan holds are left out)."""
        await self.auth.principal(context, admin=True)
        if request.limit < 0:
            raise errors.invalid_argument([("limit", "must not be negative")])
        limit = min(request.limit or self.settings.admin_max_page_size, self.settings.admin_max_page_size)
        response = admin_pb2.ListStuckTasksResponse()
        for scan in self.task_scans:
            left = limit - len(response.tasks)
            if left <= 0:
                break
            async with self.pool.acquire() as conn, conn.transaction():
                for task in await scan.due(conn, None, left):
                    response.tasks.add(task=task.to_proto(), reason=scan.stuck_reason)
        return response

    async def RequeueTasks(
        self, request: admin_pb2.RequeueTasksRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[admin_pb2.RequeueBatch]:
        """Requeues by ids or filter in batches, one response per batch with a state summary; stops on an error."""
        principal = await self.auth.principal(context, admin=True)
        if request.task_ids and request.HasField("filter"):
            raise errors.invalid_argument([("filter", "give task_ids or a filter, not both")])
        if not request.task_ids and not request.HasField("filter"):
            raise errors.invalid_argument([("task_ids", "give task_ids or a filter")])
        if not 0 <= request.batch_size <= 1000:
            raise errors.invalid_argument([("batch_size", "must be between 1 and 1000 (0 = default)")])
        batch_size = request.batch_size or self.settings.requeue_batch_size
        reason = request.reason or "operator requeue"
        number = 0
        async for ids in self._batches(request, batch_size):
            number += 1
            if request.dry_run:
                items = await self.requeuer.plan(ids)
            else:
                items = await self.requeuer.apply(ids, actor=f"admin:{principal.tenant_id}", reason=reason)
            summary = await self.pool.fetch(sql.query("admin_live_counts"))
            yield admin_pb2.RequeueBatch(
                batch=number, items=[_requeue_item(i) for i in items], summary=_state_counts(summary), dry_run=request.dry_run
            )

    async def _batches(self, request: admin_pb2.RequeueTasksRequest, batch_size: int) -> AsyncIterator[list[int]]:
        if request.task_ids:
            ids = list(dict.fromkeys(parse_task_id(v, "task_ids") for v in request.task_ids))
            for i in range(0, len(ids), batch_size):
                yield ids[i : i + batch_size]
            return
        statuses, model_id, older = self._filter(request.filter)
        if any(s.terminal for s in statuses):
            raise errors.invalid_argument([("filter.statuses", "terminal tasks cannot be requeued")])
        wanted = [s.value for s in (statuses or sorted(UNFINISHED))]
        after = 0
        while True:
            rows = await self.pool.fetch(sql.query("admin_requeue_page"), wanted, model_id, older, after, batch_size)
            if not rows:
                return
            ids = [r["id"] for r in rows]
            yield ids
            after = ids[-1]

    async def ListDeadLetters(
        self, request: admin_pb2.ListDeadLettersRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.ListDeadLettersResponse:
        """Dead letters with their tasks (last error included), newest first, a page at a time."""
        await self.auth.principal(context, admin=True)
        limit = self._page_size(request.page_size)
        before_at, before_id = decode_cursor(request.page_token) if request.page_token else (None, None)
        rows = await self.pool.fetch(sql.query("admin_dead_letters"), before_at, before_id, limit + 1)
        response = admin_pb2.ListDeadLettersResponse()
        for r in rows[:limit]:
            response.dead_letters.add(
                task=TaskRow.from_record(r).to_proto(), reason=r["dead_reason"], dead_at=timestamp(r["dead_at"])
            )
        if len(rows) > limit:
            last = rows[limit - 1]
            response.next_page_token = encode_cursor(last["dead_at"], last["id"])
        return response

    async def RedeliverCallback(
        self, request: admin_pb2.RedeliverCallbackRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.RedeliverCallbackResponse:
        """Sends a task's terminal webhooks again (same webhook ids, a fresh retry round); the notifier wakes at once."""
        await self.auth.principal(context, admin=True)
        task_id = parse_task_id(request.task_id)
        if await store.get_task(self.pool, task_id) is None:
            raise errors.not_found()
        rows: list[Any] = await callbacks.redeliver(self.pool, task_id)
        return admin_pb2.RedeliverCallbackResponse(
            deliveries=[
                admin_pb2.CallbackDelivery(
                    delivery_id=r["id"], webhook_id=r["webhook_id"], event=r["event_type"],
                    status=_CALLBACK[r["status"]], attempts=r["attempts"],
                )
                for r in rows
            ]
        )


def _requeue_item(item: Item) -> admin_pb2.RequeueItem:
    return admin_pb2.RequeueItem(
        task_id=str(item.task_id),
        from_status=item.from_status.to_proto() if item.from_status else task_pb2.TASK_STATUS_UNSPECIFIED,
        action=item.outcome.value,
        detail=item.detail,
    )
