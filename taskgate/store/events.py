"""task_event rows: what the event relay takes from its outbox and records as relayed, and what the event streams
replay. The event rows themselves are append-only."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import asyncpg

from taskgate import sql
from taskgate.states import Status
from taskgate.store.pool import Conn

# One relay pass at a time across all replicas: serialised passes keep each task's versions in order on the
# stream and give every pass a later relay time than the one before (WatchTasks cursors rely on that).
RELAY_LOCK_KEY = 0x7467_7265_6C61_7900  # "tgrelay"
MAX_VERSION = 2**62


@dataclass(frozen=True, slots=True)
class Event:
    """One task_event row: one version of one task, written by the history trigger."""

    id: int
    task_id: int
    user_id: str
    model_id: str
    version: int
    from_status: Status | None
    to_status: Status
    at: datetime
    actor: str
    reason: str | None
    progress: int
    attempt: int
    worker_id: str | None
    error_code: str | None
    error_msg: str | None
    result_uri: str | None
    result_size: int | None
    result_sha256: str | None
    result_content_type: str | None
    end_user: str = ""  # the tenant's own user the task was submitted for ('': the tenant itself)

    @classmethod
    def from_record(cls, rec: Any) -> Event:
        """Builds from a task_event record (extra columns are ignored)."""
        return cls(
            id=rec["id"],
            task_id=rec["task_id"],
            user_id=rec["user_id"],
            model_id=rec["model_id"],
            version=rec["version"],
            from_status=Status(rec["from_status"]) if rec["from_status"] is not None else None,
            to_status=Status(rec["to_status"]),
            at=rec["at"],
            actor=rec["actor"],
            reason=rec["reason"],
            progress=rec["progress"],
            attempt=rec["attempt"],
            worker_id=rec["worker_id"],
            error_code=rec["error_code"],
            error_msg=rec["error_msg"],
            result_uri=rec["result_uri"],
            result_size=rec["result_size"],
            result_sha256=rec["result_sha256"],
            result_content_type=rec["result_content_type"],
            end_user=rec.get("end_user") or "",
        )


@dataclass(frozen=True, slots=True)
class RelayEvent:
    """An event not yet on JetStream, with what the webhook outbox needs of its task."""

    event: Event
    callback_url: str | None
    callback_events: tuple[str, ...]
    metadata: dict[str, str]
    result_reused: bool
    created_at: datetime
    queued_at: datetime | None
    started_at: datetime | None
    finished_at: datetime | None
    trace_context: dict[str, str] | None = None  # the task's: the relay's span continues its trace
    device_seconds: float = 0.0  # the task's metered seconds when the relay read it
    slot_seconds: float = 0.0
    input_tokens: int = 0  # a chat task's tokens (0 for other task types)
    output_tokens: int = 0


async def lock_relay(conn: asyncpg.Connection) -> datetime | None:
    """Takes the relay lock until the open transaction ends; the pass's relay time, or None when another has it."""
    rec = await conn.fetchrow(sql.query("relay_lock"), RELAY_LOCK_KEY)
    assert rec is not None
    return rec["at"] if rec["locked"] else None


async def take_unpublished(conn: asyncpg.Connection, *, limit: int) -> list[RelayEvent]:
    """The oldest events not yet on JetStream, in id order, locked for this pass (others' locked ones skipped)."""
    return [_relay_event(r) for r in await conn.fetch(sql.query("relay_take_events"), limit)]


async def lock_and_take(conn: asyncpg.Connection, *, limit: int) -> tuple[datetime | None, list[RelayEvent]]:
    """lock_relay then take_unpublished, in one statement: the pass's relay time (None: another replica has the lock,
    and nothing was taken) and its events."""
    rows = await conn.fetch(sql.query("relay_lock_take"), RELAY_LOCK_KEY, limit)
    if not rows or not rows[0]["relay_locked"]:
        return None, []
    return rows[0]["relay_at"], [_relay_event(r) for r in rows if r["id"] is not None]


def _relay_event(r: asyncpg.Record) -> RelayEvent:
    return RelayEvent(
        event=Event.from_record(r),
        callback_url=r["callback_url"],
        callback_events=tuple(r["callback_events"] or ()),
        metadata=r["task_metadata"] or {},
        result_reused=bool(r["task_result_reused"]),
        created_at=r["task_created_at"],
        queued_at=r["task_queued_at"],
        started_at=r["task_started_at"],
        finished_at=r["task_finished_at"],
        trace_context=r["task_trace_context"],
        device_seconds=r["task_device_seconds"],
        slot_seconds=r["task_slot_seconds"],
        input_tokens=r["task_input_tokens"],
        output_tokens=r["task_output_tokens"],
    )


async def mark_published(conn: asyncpg.Connection, event_ids: Sequence[int], *, at: datetime) -> None:
    """Records that events are on JetStream, relayed by the pass of relay time `at` (out of the outbox, one pass
    row)."""
    await conn.execute(sql.query("relay_mark_published"), list(event_ids), at)


async def relay_lag(db: Conn) -> float:
    """Seconds since the oldest event not yet relayed was written (0 when none)."""
    return float(await db.fetchval(sql.query("relay_lag")))


async def task_events(db: Conn, task_id: int, *, after_version: int, up_to_version: int = MAX_VERSION) -> list[Event]:
    """A task's events with version in (after_version, up_to_version], in version order."""
    rows = await db.fetch(sql.query("stream_task_events"), task_id, after_version, up_to_version)
    return [Event.from_record(r) for r in rows]


async def events_at(db: Conn, versions: Sequence[tuple[int, int]]) -> list[Event]:
    """The events of these (task id, version) pairs that exist, in task and version order; one statement."""
    rows = await db.fetch(sql.query("stream_events_at"), [t for t, _ in versions], [v for _, v in versions])
    return [Event.from_record(r) for r in rows]


async def user_events_after(db: Conn, user_id: str, *, after_id: int, limit: int) -> list[Event]:
    """A tenant's events after an event id, in id order, at most `limit`."""
    rows = await db.fetch(sql.query("stream_user_events_after"), user_id, after_id, limit)
    return [Event.from_record(r) for r in rows]


async def user_events_lookback(db: Conn, user_id: str, *, cursor: int, relayed_at: datetime | None) -> list[Event]:
    """A tenant's events at or before `cursor` relayed at or after `relayed_at`, or not yet: ids commit out of order."""
    rows = await db.fetch(sql.query("stream_user_events_lookback"), user_id, cursor, relayed_at)
    return [Event.from_record(r) for r in rows]


async def relayed_at(db: Conn, *, event_id: int, user_id: str) -> datetime | None:
    """When a tenant's event was relayed (None: not yet, or not theirs)."""
    value: datetime | None = await db.fetchval(sql.query("stream_cursor_time"), event_id, user_id)
    return value


async def last_event_id(db: Conn, user_id: str) -> int:
    """The newest event id of a tenant (0 when none): the cursor of "from now"."""
    return int(await db.fetchval(sql.query("stream_user_last_event"), user_id))


async def task_versions(db: Conn, task_ids: Sequence[int]) -> dict[int, int]:
    """The version of each of these tasks that exists."""
    rows = await db.fetch(sql.query("stream_task_versions"), list(task_ids))
    return {int(r["id"]): int(r["version"]) for r in rows}


async def last_event_ids(db: Conn, user_ids: Sequence[str]) -> dict[str, int]:
    """The newest event id of each of these tenants (0 when none)."""
    rows = await db.fetch(sql.query("stream_users_last_events"), list(user_ids))
    return {str(r["user_id"]): int(r["last_id"]) for r in rows}
