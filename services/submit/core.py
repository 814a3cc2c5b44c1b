"""What every TaskGateway call reads (see Gateway in service.py): the servicer's settings and backends, a call's time
budget and deadline, its caller, the caller's task and its place in the queue."""

from __future__ import annotations

import asyncio
from typing import Any, TypeAlias

import grpc

from taskgate import errors, ids, paging, store
from taskgate.auth import Authenticator, Caller, Principal
from taskgate.config import GatewaySettings
from taskgate.dispatcher import Dispatcher
from taskgate.model import TaskRow
from taskgate.queueview import QueueView
from taskgate.results import result_store
from taskgate.runtime import Backends
from taskgate.sealing import Sealer
from taskgate.store import submissions
from taskgate.throttle import Throttle
from taskgate_api.v1 import gateway_pb2_grpc

from .batching import MAX_BATCH, Submitter
from .cache import FORGOTTEN_CHANNEL, TerminalCache
from .inputs import InputImages

ACTOR = "submit"

Context: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"


def _margin(remaining: float) -> float:
    """What to keep of a caller's remaining time (a fifth, 50-500 ms) to roll back and answer before it gives up."""
    return min(max(remaining * 0.2, 0.05), 0.5)


class GatewayCore(gateway_pb2_grpc.TaskGatewayServicer):
    """The servicer's settings, backends and helpers, which each group of its calls (SubmitCalls, ReadCalls,
    SecretCalls, Gateway's own) reads; Gateway adds its batches."""

    def __init__(self, settings: GatewaySettings, backends: Backends) -> None:
        self._settings = settings
        self._pool = backends.pool
        self._bus = backends.bus
        self._throttle = Throttle.of(settings)
        self._auth = Authenticator(
            backends.pool, settings.api_key_pepper, settings.api_key_cache_seconds, throttle=self._throttle,
            service="submit",
        )
        self.draining = asyncio.Event()  # set when the server stops: SubmitStream streams read no more and end
        self._cache = TerminalCache(settings.result_cache_size, settings.result_cache_seconds)
        # one connection hears revoked keys and forgotten tasks (deleted, or their output expired)
        self.revocations = self._auth.listener(backends.database_url, {FORGOTTEN_CHANNEL: self._cache.forget})
        self._pages = paging.Pager(settings.api_key_pepper)
        self._sealer = Sealer.of(settings)
        self._queue = QueueView(backends.pool, settings)
        self._results = result_store(settings, backends.bus)
        self.inputs = InputImages(backends.pool, self._results, settings)
        self.ids = ids.LeasedIds(
            backends.pool, lease_seconds=settings.id_node_lease_seconds, fixed_node=settings.id_node
        )
        self.dispatcher = Dispatcher(
            backends.pool, backends.bus, actor=ACTOR, ack_timeout=settings.submit_publish_timeout_seconds,
            db_timeout=settings.submit_db_timeout_seconds, max_batch=MAX_BATCH,
        )
        self._end_user_limits = submissions.EndUserLimits(
            settings.max_pending_per_end_user, settings.submits_per_minute_per_end_user
        )
        self._submitter = Submitter(
            backends.pool, self.dispatcher, default_max_pending=settings.max_pending_per_tenant,
            db_timeout=settings.submit_db_timeout_seconds,
            history=submissions.History(settings.eta_history_seconds, settings.eta_history_runs),
            end_users=self._end_user_limits,
        )

    def _budget(self, context: Context, cap: float | None = None) -> float:
        """Seconds one backend call may take: the configured cap, shortened to fit the client's deadline."""
        cap = self._settings.submit_db_timeout_seconds if cap is None else cap
        remaining = context.time_remaining()
        if remaining is None:
            return cap
        return max(min(cap, remaining - _margin(remaining)), 0.001)

    async def _principal(self, context: Context) -> Principal:
        async with asyncio.timeout(self._budget(context)):  # no task per call, as wait_for would make
            return await self._auth.principal(context)

    def _caller_deadline(self, context: Context) -> float | None:
        """The loop time by which this caller must hear back (None: it set no deadline), keeping the same margin as
        _budget; a batch the caller joins has its own statement timeout, never this."""
        remaining = context.time_remaining()
        if remaining is None:
            return None
        return asyncio.get_running_loop().time() + remaining - _margin(remaining)

    async def _queue_position(self, task: TaskRow, context: Context) -> int:
        return await submissions.queue_position(self._pool, task, within=self._budget(context))

    async def _load(self, tenant: str | Caller, task_id: int, context: Context) -> TaskRow:
        """The caller's task; NOT_FOUND for a missing id and for another tenant's task alike (and, for a client
        token, for another end user's task or one it does not list)."""
        task = self._cache.get(task_id)
        if task is None:
            async with asyncio.timeout(self._budget(context)):  # no task per call, as wait_for would make
                task = await store.get_task(self._pool, task_id)
            if task is not None:
                self._cache.put(task)
        who = tenant if isinstance(tenant, Caller) else Caller(Principal(tenant, None, None))
        if task is None or not who.may_see(task.user_id, task.end_user, task.id):
            raise errors.not_found()
        return task

    async def _caller(self, context: Context, scope: str) -> Caller:
        """The tenant by its API key, or a client token with `scope`."""
        async with asyncio.timeout(self._budget(context)):
            return await self._auth.caller(context, scope)
