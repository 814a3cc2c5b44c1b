"""The asyncio client's admin calls (TaskAdmin, with an admin key): stats, stuck and dead tasks, requeues, webhook
deliveries, the audit log, keys, usage, purges."""

from __future__ import annotations

import builtins
from collections.abc import AsyncIterator, Iterable
from datetime import datetime

import grpc

from taskgate_api.v1 import admin_pb2, task_pb2
from taskgate_client.channels import ClientCore
from taskgate_client.errors import from_rpc_error
from taskgate_client.messages import StatusFilter, duration, wire_statuses


class AdminCalls(ClientCore):
    """The operator's calls (they need an admin key)."""

    async def stats(self) -> admin_pb2.GetStatsResponse:
        """Task counts per model and state, the oldest queued age, workers and callback counts."""
        return await self._call(
            lambda: self.admin_stub.GetStats(
                admin_pb2.GetStatsRequest(), metadata=self.admin_metadata, timeout=self.config.call_timeout
            )
        )

    async def stuck(self, limit: int = 100) -> builtins.list[admin_pb2.StuckTask]:
        """Tasks the scheduler considers stuck, each with why."""
        response = await self._call(
            lambda: self.admin_stub.ListStuckTasks(
                admin_pb2.ListStuckTasksRequest(limit=limit),
                metadata=self.admin_metadata,
                timeout=self.config.call_timeout,
            )
        )
        return list(response.tasks)

    async def requeue(
        self,
        task_ids: Iterable[str] = (),
        *,
        status: StatusFilter = None,
        model: str | None = None,
        older_than: float | None = None,
        dry_run: bool = False,
        batch_size: int = 50,
        reason: str = "",
        replay_finished: bool = False,
    ) -> AsyncIterator[admin_pb2.RequeueBatch]:
        """Requeues the given tasks (or those matching the filter) in batches, yielding each batch's report.

        FAILED and TIMEOUT tasks stay terminal: with `replay_finished` each is replayed once as a new task with the same
        request and seed (item action REPLAYED, detail "as task <id>"), created past its tenant's limits and dispatched
        at once; without it they are SKIPPED, as SUCCEEDED and CANCELED tasks always are.
        """
        request = admin_pb2.RequeueTasksRequest(
            task_ids=list(task_ids),
            dry_run=dry_run,
            batch_size=batch_size,
            reason=reason,
            replay_finished=replay_finished,
        )
        if status is not None or model or older_than is not None:
            request.filter.CopyFrom(admin_pb2.TaskFilter(statuses=wire_statuses(status), model_id=model or ""))
            if older_than is not None:
                request.filter.older_than.CopyFrom(duration(older_than))
        call = self.admin_stub.RequeueTasks(request, metadata=self.admin_metadata)
        try:
            async for batch in call:
                yield batch
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from None
        finally:
            call.cancel()

    async def dead_letters(self, *, page_size: int = 100) -> AsyncIterator[admin_pb2.DeadLetter]:
        """Tasks that failed for good, newest first, fetching pages as the iteration goes."""
        token = ""
        while True:
            request = admin_pb2.ListDeadLettersRequest(page_size=page_size, page_token=token)
            response = await self._call(
                lambda r=request: self.admin_stub.ListDeadLetters(  # type: ignore[misc]
                    r, metadata=self.admin_metadata, timeout=self.config.call_timeout
                )
            )
            for item in response.dead_letters:
                yield item
            token = response.next_page_token
            if not token:
                return

    async def redeliver(self, task_id: str) -> builtins.list[admin_pb2.CallbackDelivery]:
        """Sends a task's callbacks again (failed or delivered); returns the deliveries scheduled."""
        response = await self._call(
            lambda: self.admin_stub.RedeliverCallback(
                admin_pb2.RedeliverCallbackRequest(task_id=task_id),
                metadata=self.admin_metadata,
                timeout=self.config.call_timeout,
            )
        )
        return list(response.deliveries)

    async def deliveries(
        self, status: str | None = None, *, page_size: int = 100
    ) -> AsyncIterator[admin_pb2.DeliveryRecord]:
        """Webhook deliveries in a state (PENDING, DELIVERED, FAILED; None: all), newest first, with attempts and last
        error."""
        wanted = task_pb2.CallbackStatus.Value(f"CALLBACK_STATUS_{status.upper()}") if status else 0
        token = ""
        while True:
            request = admin_pb2.ListCallbackDeliveriesRequest(status=wanted, page_size=page_size, page_token=token)  # type: ignore[arg-type]
            response = await self._call(
                lambda r=request: self.admin_stub.ListCallbackDeliveries(  # type: ignore[misc]
                    r, metadata=self.admin_metadata, timeout=self.config.call_timeout
                )
            )
            for item in response.deliveries:
                yield item
            token = response.next_page_token
            if not token:
                return

    async def audit(self, admin: str | None = None, *, page_size: int = 100) -> AsyncIterator[admin_pb2.AuditEvent]:
        """What admins did (one admin's when given), newest first: who, what, on what, when, dry run or not."""
        token = ""
        while True:
            request = admin_pb2.ListAuditEventsRequest(admin=admin or "", page_size=page_size, page_token=token)
            response = await self._call(
                lambda r=request: self.admin_stub.ListAuditEvents(  # type: ignore[misc]
                    r, metadata=self.admin_metadata, timeout=self.config.call_timeout
                )
            )
            for item in response.events:
                yield item
            token = response.next_page_token
            if not token:
                return

    async def rotate_webhook_secret(
        self, tenant: str, *, overlap: float = 24 * 3600.0
    ) -> admin_pb2.RotateWebhookSecretResponse:
        """A new webhook secret for `tenant` (shown once); its current ones keep signing for `overlap` seconds.

        Not retried: a retry after a lost answer would rotate again and the secret shown first would be lost.
        """
        request = admin_pb2.RotateWebhookSecretRequest(tenant=tenant, overlap=duration(overlap))
        try:
            return await self.admin_stub.RotateWebhookSecret(
                request, metadata=self.admin_metadata, timeout=self.config.call_timeout
            )
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from None

    async def api_keys(self, tenant: str | None = None) -> builtins.list[admin_pb2.ApiKeyInfo]:
        """Every API key (of `tenant` when given) by prefix, newest first."""
        request = admin_pb2.ListApiKeysRequest(tenant=tenant or "")
        response = await self._call(
            lambda: self.admin_stub.ListApiKeys(request, metadata=self.admin_metadata, timeout=self.config.call_timeout)
        )
        return list(response.keys)

    async def revoke_api_keys(self, prefix: str) -> int:
        """Revokes the live keys with a prefix (as `api_keys` lists it); how many. NotFound when none is live."""
        request = admin_pb2.RevokeApiKeysRequest(prefix=prefix)
        response = await self._call(
            lambda: self.admin_stub.RevokeApiKeys(
                request, metadata=self.admin_metadata, timeout=self.config.call_timeout
            )
        )
        return response.revoked

    async def usage(
        self, tenant: str | None = None, *, since: datetime | None = None, until: datetime | None = None,
        by_hour: bool = False, by_end_user: bool = False, end_user: str | None = None,
    ) -> admin_pb2.GetUsageResponse:
        """Metered GPU-seconds and slot seconds per tenant and model (per UTC hour with `by_hour`, per end user with
        `by_end_user`; `end_user`: only that one of `tenant`'s) from `since`'s hour (default: 24 hours ago) to before
        `until` (default: now)."""
        request = admin_pb2.GetUsageRequest(tenant=tenant or "", by_hour=by_hour, by_end_user=by_end_user)
        if end_user is not None:
            request.end_user = end_user
        if since is not None:
            request.since.FromDatetime(since)
        if until is not None:
            request.until.FromDatetime(until)
        return await self._call(
            lambda: self.admin_stub.GetUsage(request, metadata=self.admin_metadata, timeout=self.config.call_timeout)
        )

    async def purge(self, older_than: float, *, dry_run: bool = False) -> admin_pb2.PurgeTasksResponse:
        """Deletes finished tasks (with their history and outputs) and reusable outputs older than `older_than`
        seconds; `dry_run` only counts. Not retried: a purge cut short is safe to ask for again."""
        request = admin_pb2.PurgeTasksRequest(older_than=duration(older_than), dry_run=dry_run)
        try:
            return await self.admin_stub.PurgeTasks(request, metadata=self.admin_metadata)
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from None
