"""What every TaskAdmin call reads (AdminCore, the servicer's base): the scheduler's settings, pool, admin key
check, webhook-secret sealer, page tokens, scans, requeuer and retention scan; a page token's position, a page's size
and a task filter as checked; and the audit record an admin action leaves before it runs.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence

import asyncpg
from google.protobuf import json_format, text_format
from google.protobuf.message import Message

from services.scheduler import adminwire
from services.scheduler.requeue import Requeuer
from services.scheduler.retention import RetentionScan
from services.scheduler.scans import TaskScan
from taskgate import auth, errors, paging, text
from taskgate import bus as busmod
from taskgate.auth import Authenticator
from taskgate.config import SchedulerSettings
from taskgate.sealing import Sealer
from taskgate.states import Status
from taskgate.store import admins as admin_audit
from taskgate.throttle import Throttle
from taskgate_api.v1 import admin_pb2

log = logging.getLogger("taskgate.admin")


class AdminCore:
    """What the TaskAdmin servicer's calls share: its backends, its checks of a request's paging and filter, its
    audit."""

    def __init__(
        self,
        settings: SchedulerSettings,
        pool: asyncpg.Pool,
        bus: busmod.Bus,
        task_scans: Sequence[TaskScan],
        retention: RetentionScan,
    ) -> None:
        self.settings = settings
        self.pool = pool
        self.auth = Authenticator(
            pool,
            settings.api_key_pepper,
            settings.api_key_cache_seconds,
            throttle=Throttle.of(settings),
            service="admin",
        )
        self.sealer = Sealer.of(settings)
        self.pages = paging.Pager(settings.api_key_pepper)
        self.task_scans = list(task_scans)
        self.requeuer = Requeuer(
            pool,
            bus,
            ack_timeout=settings.submit_publish_timeout_seconds,
            db_timeout=settings.submit_db_timeout_seconds,
        )
        self.retention = retention  # the scheduler's own: one result store (one S3 client) per process

    def _cursor(self, token: str, fingerprint: str) -> paging.Cursor | None:
        """The keyset position of a page token (None: the first page); INVALID_ARGUMENT when it is not one of ours."""
        if not token:
            return None
        try:
            return self.pages.decode(token, fingerprint)
        except paging.BadToken as exc:
            raise errors.invalid_argument([("page_token", str(exc))]) from None

    def _page_size(self, requested: int, field: str = "page_size") -> int:
        if requested < 0:
            raise errors.invalid_argument([(field, "must not be negative")])
        return min(requested or self.settings.admin_page_size, self.settings.admin_max_page_size)

    def _filter(self, f: admin_pb2.TaskFilter) -> tuple[list[Status], str | None, float | None]:
        older = f.older_than.ToTimedelta().total_seconds() if f.HasField("older_than") else None
        if older is not None and older < 0:
            raise errors.invalid_argument([("filter.older_than", "must not be negative")])
        bad: list[tuple[str, str]] = []
        text.check("filter.model_id", [f.model_id], bad)
        if bad:
            raise errors.invalid_argument(bad)
        return adminwire.statuses(f.statuses, "filter.statuses"), f.model_id or None, older

    async def _audit(
        self, who: auth.Admin, action: str, request: Message, *, target: str = "", dry_run: bool = False
    ) -> None:
        """Records an admin action as it was asked for (before it runs: an action is never done unrecorded)."""
        try:
            detail = json_format.MessageToDict(request, preserving_proto_field_name=True)
        except json_format.Error:  # a field JSON cannot hold (a malformed Duration): the text form, still recorded
            detail = {"request": text_format.MessageToString(request, as_one_line=True)}
        # PostgreSQL stores no U+0000 (text nor jsonb): a request that carries one is recorded with U+FFFD instead
        detail = json.loads(json.dumps(detail).replace("\\u0000", "\\ufffd"))
        target = target.replace("\x00", "\ufffd")
        await admin_audit.record(self.pool, who, action, target=target, dry_run=dry_run, detail=detail)
        log.info("admin action", extra={"admin": who.name, "action": action, "target": target, "dry_run": dry_run})
