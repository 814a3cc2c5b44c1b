"""TaskAdmin: the operators' API (admin key required) — stats, listings, stuck tasks, requeues, dead letters."""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import grpc

from services.scheduler import adminwire
from services.scheduler.admincore import AdminCore
from services.scheduler.requeue import REPLAYABLE
from services.scheduler.retention import Retention
from services.scheduler.scans import Action, count
from taskgate import auth, errors, ids, output, paging, results, store, text
from taskgate.auth import DEFAULT_SECRET_OVERLAP
from taskgate.model import timestamp
from taskgate.states import UNFINISHED, CallbackStatus
from taskgate.store import admin as admin_store
from taskgate.store import admins as admin_audit
from taskgate.store import maintenance, tenants, usage
from taskgate.store import webhooks as webhook_store
from taskgate.store import workers as worker_store
from taskgate_api.v1 import admin_pb2, admin_pb2_grpc, task_pb2

log = logging.getLogger("taskgate.admin")

_DEAD_LETTERS = paging.filter_key("admin.dead_letters")  # no filter, but its tokens fit no other listing



class TaskAdminService(AdminCore, admin_pb2_grpc.TaskAdminServicer):
    """The TaskAdmin servicer; every call needs an admin key."""

    async def GetStats(
        self, request: admin_pb2.GetStatsRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.GetStatsResponse:
        """Counts per state and model (and the unfinished ones per priority too), the oldest QUEUED age, tasks per
        worker, webhook outcomes, the cluster's load."""
        await self.auth.admin(context, scope=auth.READ)
        async with self.pool.acquire() as conn:
            counts = await admin_store.state_counts(conn)
            live = await admin_store.live_priority_counts(conn)
            oldest = await admin_store.oldest_queued_age(conn)
            workers = await admin_store.worker_stats(conn, lease_seconds=self.settings.lease_seconds)
            deliveries = await admin_store.callback_counts(conn)
            load = await worker_store.cluster_load(conn, lease_seconds=self.settings.lease_seconds)
        response = admin_pb2.GetStatsResponse(
            counts=adminwire.state_counts(counts),
            live=adminwire.state_counts(live),
            callbacks=[admin_pb2.CallbackCount(status=c.status.to_proto(), count=c.count) for c in deliveries],
            capacity=load.capacity,
            running=load.running,
        )
        if oldest is not None:
            response.oldest_queued_age.CopyFrom(adminwire.duration(oldest))
        for w in workers:
            stats = response.workers.add(
                worker_id=w.worker_id,
                running=w.running,
                slots=w.slots,
                alive=w.alive,
                device=w.device,
                draining=w.draining,
                address=w.control_address,
                devices=w.devices,
                capacity=w.capacity,
            )
            if w.last_heartbeat is not None:
                stats.last_heartbeat.CopyFrom(timestamp(w.last_heartbeat))
        return response

    async def ListTasks(
        self, request: admin_pb2.AdminListTasksRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.AdminListTasksResponse:
        """Tasks by state, model and age (least recently updated first, or most recently), a page at a time."""
        await self.auth.admin(context, scope=auth.READ)
        statuses, model_id, older = self._filter(request.filter)
        limit = self._page_size(request.page_size)
        # a token of one order is no position in the other (the oldest-first fingerprint is as it always was)
        order = ("newest",) if request.newest_first else ()
        fingerprint = paging.filter_key("admin.tasks", sorted({s.value for s in statuses}), model_id, older, *order)
        after = self._cursor(request.page_token, fingerprint)
        rows = await admin_store.list_tasks(
            self.pool, statuses=statuses, model_id=model_id, older_than_seconds=older, after=after, limit=limit + 1,
            newest_first=request.newest_first,
        )
        tasks = rows[:limit]
        token = (
            self.pages.encode(paging.Cursor(tasks[-1].updated_at, tasks[-1].id), fingerprint)
            if len(rows) > limit
            else ""
        )
        return admin_pb2.AdminListTasksResponse(tasks=[t.to_proto() for t in tasks], next_page_token=token)

    async def ListStuckTasks(
        self, request: admin_pb2.ListStuckTasksRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.ListStuckTasksResponse:
        """What the scans would act on now, with why (the scans' own queries; rows a scan holds are left out)."""
        await self.auth.admin(context, scope=auth.READ)
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
        """Requeues by ids or filter in batches, one response per batch with a state summary; stops on an error. With
        replay_finished, FAILED and TIMEOUT tasks are replayed as new tasks, with ids from a node number leased for
        this call only (replays are rare; a scheduler holds none otherwise)."""
        principal = await self.auth.admin(context, scope=auth.OPERATOR)
        if request.task_ids and request.HasField("filter"):
            raise errors.invalid_argument([("filter", "give task_ids or a filter, not both")])
        if not request.task_ids and not request.HasField("filter"):
            raise errors.invalid_argument([("task_ids", "give task_ids or a filter")])
        if not 0 <= request.batch_size <= 1000:
            raise errors.invalid_argument([("batch_size", "must be between 1 and 1000 (0 = default)")])
        batch_size = request.batch_size or self.settings.requeue_batch_size
        reason = request.reason or "operator requeue"
        bad: list[tuple[str, str]] = []
        text.check("reason", [reason], bad)  # stored as the transition's reason
        if not bad:
            await self._audit(principal, "RequeueTasks", request, dry_run=request.dry_run)
        if bad:
            raise errors.invalid_argument(bad)
        replay_ids = await self._replay_ids() if request.replay_finished and not request.dry_run else None
        try:
            number = 0
            async for batch in self._batches(request, batch_size):
                number += 1
                if request.dry_run:
                    items = await self.requeuer.plan(batch, replay_finished=request.replay_finished)
                else:
                    items = await self.requeuer.apply(
                        batch, actor=f"admin:{principal.name}", reason=reason,
                        new_id=replay_ids.next if replay_ids is not None else None,
                    )
                summary = await admin_store.live_counts(self.pool)
                yield admin_pb2.RequeueBatch(
                    batch=number,
                    items=[adminwire.requeue_item(i) for i in items],
                    summary=adminwire.state_counts(summary),
                    dry_run=request.dry_run,
                )
        finally:
            if replay_ids is not None:
                await replay_ids.close()

    async def _replay_ids(self) -> ids.LeasedIds:
        """Task ids for this call's replays, from a leased node number (never the fixed one of a submit replica)."""
        leased = ids.LeasedIds(self.pool, lease_seconds=self.settings.id_node_lease_seconds)
        try:
            await leased.start()
        except ids.NoFreeNode as exc:
            raise errors.unavailable(f"cannot make task ids for the replays: {exc}") from None
        return leased

    async def _batches(self, request: admin_pb2.RequeueTasksRequest, batch_size: int) -> AsyncIterator[list[int]]:
        if request.task_ids:
            task_ids = list(dict.fromkeys(ids.require(v, "task_ids") for v in request.task_ids))
            for i in range(0, len(task_ids), batch_size):
                yield task_ids[i : i + batch_size]
            return
        statuses, model_id, older = self._filter(request.filter)
        if any(s.terminal and s not in REPLAYABLE for s in statuses):
            raise errors.invalid_argument(
                [("filter.statuses", "SUCCEEDED and CANCELED tasks are never requeued or replayed")]
            )
        if any(s in REPLAYABLE for s in statuses) and not request.replay_finished:
            raise errors.invalid_argument(
                [
                    (
                        "filter.statuses",
                        "FAILED and TIMEOUT are terminal: pass replay_finished to replay them as new tasks",
                    )
                ]
            )
        wanted = statuses or sorted(UNFINISHED | (REPLAYABLE if request.replay_finished else frozenset()))
        after = 0
        while True:
            page = await admin_store.requeue_page(
                self.pool,
                statuses=wanted,
                model_id=model_id,
                older_than_seconds=older,
                after_id=after,
                limit=batch_size,
            )
            if not page:
                return
            yield page
            after = page[-1]

    async def ListDeadLetters(
        self, request: admin_pb2.ListDeadLettersRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.ListDeadLettersResponse:
        """Dead letters with their tasks (last error included) and their replays, newest first, a page at a time."""
        await self.auth.admin(context, scope=auth.READ)
        limit = self._page_size(request.page_size)
        before = self._cursor(request.page_token, _DEAD_LETTERS)
        rows = await admin_store.dead_letters(self.pool, before=before, limit=limit + 1)
        response = admin_pb2.ListDeadLettersResponse()
        for d in rows[:limit]:
            letter = response.dead_letters.add(task=d.task.to_proto(), reason=d.reason, dead_at=timestamp(d.dead_at))
            if d.replayed_as is not None and d.replayed_at is not None:
                letter.replayed_as = str(d.replayed_as)
                letter.replayed_at.CopyFrom(timestamp(d.replayed_at))
        if len(rows) > limit:
            last = rows[limit - 1]
            response.next_page_token = self.pages.encode(paging.Cursor(last.dead_at, last.task.id), _DEAD_LETTERS)
        return response

    async def RedeliverCallback(
        self, request: admin_pb2.RedeliverCallbackRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.RedeliverCallbackResponse:
        """Sends a task's terminal webhooks again (same webhook ids, a fresh retry round); the notifier wakes at
        once."""
        who = await self.auth.admin(context, scope=auth.OPERATOR)
        task_id = ids.require(request.task_id)
        await self._audit(who, "RedeliverCallback", request, target=str(task_id))
        if await store.get_task(self.pool, task_id) is None:
            raise errors.not_found()
        reset = await webhook_store.redeliver(self.pool, task_id)
        return admin_pb2.RedeliverCallbackResponse(
            deliveries=[
                admin_pb2.CallbackDelivery(
                    delivery_id=d.id, webhook_id=d.webhook_id, event=d.event_type, status=d.status.to_proto(),
                    attempts=d.attempts,
                )
                for d in reset
            ]
        )

    async def ListCallbackDeliveries(
        self, request: admin_pb2.ListCallbackDeliveriesRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.ListCallbackDeliveriesResponse:
        """Webhook deliveries in a state (all when unspecified), newest first, with attempts and last error."""
        await self.auth.admin(context, scope=auth.READ)
        status = None
        if request.status:
            name = (
                task_pb2.CallbackStatus.Name(request.status)
                if request.status in task_pb2.CallbackStatus.values()
                else ""
            )
            if name.removeprefix("CALLBACK_STATUS_") not in CallbackStatus.__members__:
                raise errors.invalid_argument([("status", "unknown callback status")])
            status = CallbackStatus(name.removeprefix("CALLBACK_STATUS_"))
        limit = self._page_size(request.page_size)
        fingerprint = paging.filter_key("admin.deliveries", status.value if status else None)
        rows = await admin_store.deliveries(
            self.pool, status=status, before=self._cursor(request.page_token, fingerprint), limit=limit + 1
        )
        response = admin_pb2.ListCallbackDeliveriesResponse()
        for d in rows[:limit]:
            record = response.deliveries.add(
                delivery_id=d.id, task_id=str(d.task_id), tenant=d.user_id, webhook_id=d.webhook_id, event=d.event_type,
                url=d.url, status=d.status.to_proto(), attempts=d.attempts, last_status_code=d.last_status_code or 0,
                last_error=d.last_error or "", created_at=timestamp(d.created_at),
            )
            if d.status is CallbackStatus.PENDING:
                record.next_attempt_at.CopyFrom(timestamp(d.next_attempt_at))
            if d.last_attempt_at is not None:
                record.last_attempt_at.CopyFrom(timestamp(d.last_attempt_at))
        if len(rows) > limit:
            last = rows[limit - 1]
            response.next_page_token = self.pages.encode(paging.Cursor(last.created_at, last.id), fingerprint)
        return response

    async def _existing_tenant(self, tenant: str) -> str:
        """The tenant named by a request; INVALID_ARGUMENT for a name no tenant can have, NOT_FOUND for none."""
        if not auth.valid_tenant_name(tenant):
            raise errors.invalid_argument([("tenant", "must be 1-64 of A-Z a-z 0-9 _ -")])
        if not await tenants.tenant_exists(self.pool, tenant):
            raise errors.not_found("tenant")
        return tenant

    async def RotateWebhookSecret(
        self, request: admin_pb2.RotateWebhookSecretRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.RotateWebhookSecretResponse:
        """Adds a webhook secret; the tenant's current ones keep signing until the overlap (default 24 h) ends."""
        who = await self.auth.admin(context, scope=auth.OPERATOR)
        overlap = (
            request.overlap.ToTimedelta().total_seconds() if request.HasField("overlap") else DEFAULT_SECRET_OVERLAP
        )
        if overlap < 0:
            raise errors.invalid_argument([("overlap", "must not be negative")])
        tenant = await self._existing_tenant(request.tenant)
        await self._audit(who, "RotateWebhookSecret", request, target=tenant)
        rotated = await auth.rotate_webhook_secret(self.pool, tenant, overlap, self.sealer)
        log.info(
            "webhook secret rotated",
            extra={"tenant": tenant, "overlap_seconds": overlap, "valid_secrets": rotated.valid_secrets},
        )
        return admin_pb2.RotateWebhookSecretResponse(
            webhook_secret=rotated.secret, previous_valid_until=timestamp(rotated.previous_valid_until),
            valid_secrets=rotated.valid_secrets,
        )

    async def ListApiKeys(
        self, request: admin_pb2.ListApiKeysRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.ListApiKeysResponse:
        """Every key (of one tenant when given) by prefix, newest first; the keys themselves are not stored."""
        await self.auth.admin(context, scope=auth.READ)
        if request.tenant and not auth.valid_tenant_name(request.tenant):
            raise errors.invalid_argument([("tenant", "must be 1-64 of A-Z a-z 0-9 _ -")])
        response = admin_pb2.ListApiKeysResponse()
        for k in await tenants.list_api_keys(self.pool, request.tenant or None):
            info = response.keys.add(
                prefix=k.prefix,
                tenant=k.tenant_id,
                admin=k.is_admin,
                created_at=timestamp(k.created_at),
                scope=k.scope or "",
            )
            if k.revoked_at is not None:
                info.revoked_at.CopyFrom(timestamp(k.revoked_at))
            if k.expires_at is not None:
                info.expires_at.CopyFrom(timestamp(k.expires_at))
        return response

    async def GetTaskPreview(
        self, request: admin_pb2.GetTaskPreviewRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.GetTaskPreviewResponse:
        """The newest stored preview image of a task (one named but not stored yet, or gone, gives way to the one
        before it)."""
        await self.auth.admin(context, scope=auth.READ)
        task_id = ids.require(request.task_id)
        for uri in reversed(await admin_store.task_previews(self.pool, task_id)):
            try:
                data = b"".join([part async for part in self.retention.outputs.read(uri)])
            except results.ResultNotFound:
                continue
            return admin_pb2.GetTaskPreviewResponse(uri=uri, content_type=output.preview_type(uri), data=data)
        raise errors.not_found("preview")

    async def GetUsage(
        self, request: admin_pb2.GetUsageRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.GetUsageResponse:
        """Metered seconds per tenant and model (per hour when asked) over a range of hours, from usage_hour."""
        await self.auth.admin(context, scope=auth.READ)
        bad: list[tuple[str, str]] = []
        if request.tenant and not auth.valid_tenant_name(request.tenant):
            bad.append(("tenant", "must be 1-64 of A-Z a-z 0-9 _ -"))
        now = datetime.now(UTC)
        until = adminwire.moment(request.until, "until", bad) if request.HasField("until") else now
        since = adminwire.moment(request.since, "since", bad) if request.HasField("since") else now - timedelta(days=1)
        if not bad and since >= until:
            bad.append(("since", "must be before until"))
        end_user = request.end_user if request.HasField("end_user") else None
        if end_user is not None:
            if not request.tenant:
                bad.append(("end_user", "needs a tenant: end users are each tenant's own"))
            elif (why := text.unstorable(end_user)) is not None:
                bad.append(("end_user", why))
        if bad:
            raise errors.invalid_argument(bad)
        limit = self.settings.usage_max_rows
        rows = await usage.usage(
            self.pool,
            since=since,
            until=until,
            tenant_id=request.tenant or None,
            by_hour=request.by_hour,
            limit=limit + 1,
            by_end_user=request.by_end_user or end_user is not None,
            end_user=end_user,
        )
        response = admin_pb2.GetUsageResponse(
            since=timestamp(since), until=timestamp(until), truncated=len(rows) > limit
        )
        for u in rows[:limit]:
            row = response.rows.add(
                tenant=u.tenant_id,
                model_id=u.model_id,
                gpu_seconds=u.device_seconds,
                slot_seconds=u.slot_seconds,
                attempts=u.attempts,
                end_user=u.end_user or "",
                input_tokens=u.input_tokens,
                output_tokens=u.output_tokens,
            )
            if u.hour is not None:
                row.hour.CopyFrom(timestamp(u.hour))
        return response

    async def RevokeApiKeys(
        self, request: admin_pb2.RevokeApiKeysRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.RevokeApiKeysResponse:
        """Revokes the live keys with a prefix; NOT_FOUND when none is live (gateways notice within their key cache)."""
        who = await self.auth.admin(context, scope=auth.OPERATOR)
        bad: list[tuple[str, str]] = []
        text.check("prefix", [request.prefix], bad)
        if not request.prefix:
            bad.append(("prefix", "is required"))
        if bad:
            raise errors.invalid_argument(bad)
        await self._audit(who, "RevokeApiKeys", request, target=request.prefix)
        revoked = await tenants.revoke_api_keys(self.pool, request.prefix)
        if not revoked:
            raise errors.not_found("live key with that prefix")
        log.info("api keys revoked", extra={"prefix": request.prefix, "count": len(revoked), "by": who.name})
        return admin_pb2.RevokeApiKeysResponse(revoked=len(revoked))

    async def PurgeTasks(
        self, request: admin_pb2.PurgeTasksRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.PurgeTasksResponse:
        """Deletes finished tasks (with their history and outputs) and reusable outputs older than older_than, in
        scan-sized skip-locked batches; dry_run only counts (outputs: at most that many, shared ones may stay)."""
        who = await self.auth.admin(context, scope=auth.OPERATOR)
        if not request.HasField("older_than"):
            raise errors.invalid_argument([("older_than", "is required")])
        older = request.older_than.ToTimedelta().total_seconds()
        if older < 0:
            raise errors.invalid_argument([("older_than", "must not be negative")])
        await self._audit(who, "PurgeTasks", request, dry_run=request.dry_run)
        if request.dry_run:
            would = await maintenance.retention_counts(self.pool, older_than_seconds=older)
            return admin_pb2.PurgeTasksResponse(
                tasks=would.tasks, results=would.results, reusable_results=would.reusable_results, dry_run=True,
                kept=adminwire.kept(would),
            )
        limit = self.settings.scan_batch_size
        done: Counter[Action] = Counter()
        while True:
            batch = await self.retention.purge(Retention(tasks=older, reusable=older), limit=limit)
            count(batch)
            done.update(batch.actions)
            if batch.examined < limit:
                break
        left = await maintenance.retention_counts(self.pool, older_than_seconds=older)
        return admin_pb2.PurgeTasksResponse(
            tasks=done[Action.PURGE_TASK],
            results=done[Action.PURGE_RESULT],
            reusable_results=done[Action.PURGE_REUSABLE],
            kept=adminwire.kept(left),
        )

    async def ListAuditEvents(
        self, request: admin_pb2.ListAuditEventsRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.ListAuditEventsResponse:
        """What admins did, newest first (one admin's when `admin` is given), a page at a time."""
        await self.auth.admin(context, scope=auth.READ)
        limit = self._page_size(request.page_size)
        fingerprint = paging.filter_key("admin.audit", request.admin or None)
        cursor = self._cursor(request.page_token, fingerprint)
        rows = await admin_audit.audit(
            self.pool, before_id=cursor.task_id if cursor else None, admin=request.admin or None, limit=limit + 1
        )
        response = admin_pb2.ListAuditEventsResponse()
        for e in rows[:limit]:
            response.events.add(
                id=e.id, at=timestamp(e.at), admin=e.admin, prefix=e.prefix, action=e.action, target=e.target,
                dry_run=e.dry_run, detail=json.dumps(e.detail, sort_keys=True),
            )
        if len(rows) > limit:
            last = rows[limit - 1]
            response.next_page_token = self.pages.encode(paging.Cursor(last.at, last.id), fingerprint)
        return response

    async def Authorize(
        self, request: admin_pb2.AuthorizeRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.AuthorizeResponse:
        """Checks the caller's admin credential for an action a worker performs (its WorkerControl calls)."""
        if request.action not in WORKER_ACTIONS:
            raise errors.invalid_argument([("action", f"must be one of {', '.join(sorted(WORKER_ACTIONS))}")])
        scope = auth.OPERATOR if request.action == "worker.drain" else auth.READ
        who = await self.auth.admin(context, scope=scope)
        if scope == auth.OPERATOR:
            await self._audit(who, request.action, request, target=request.target)
        return admin_pb2.AuthorizeResponse(admin=who.name)


WORKER_ACTIONS = frozenset({"worker.status", "worker.drain"})  # what Authorize vouches for
