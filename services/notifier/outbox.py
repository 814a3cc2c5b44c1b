"""The callback outbox: which events become webhooks, their JSON body, and replaying them (RedeliverCallback)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import asyncpg

from taskgate import sql
from taskgate.callbacks import redeliver
from taskgate.states import Status

TERMINAL_WITH_WEBHOOK = frozenset({Status.SUCCEEDED, Status.FAILED, Status.TIMEOUT})
PROGRESS_TYPE = "task.progress"


@dataclass(frozen=True, slots=True)
class Delivery:
    """A webhook to insert into the outbox for one event."""

    task_id: int
    event_id: int
    user_id: str
    webhook_id: str
    event_type: str
    url: str
    payload: dict[str, Any]


def _filters(events: Sequence[str] | None) -> set[str]:
    """The submitter's event filter, tolerant of 'canceled', 'task.canceled', 'TASK_STATUS_CANCELED', ..."""
    out = set()
    for name in events or ():
        token = name.strip().upper().removeprefix("TASK_STATUS_").removeprefix("TASK.")
        out.add("CANCELED" if token == "CANCELLED" else token)
    return out


def event_type(to_status: Status, callback_events: Sequence[str] | None) -> str | None:
    """The webhook type an event into `to_status` produces for this filter, or None when it produces none."""
    if to_status in TERMINAL_WITH_WEBHOOK:
        return f"task.{to_status.value.lower()}"
    wanted = _filters(callback_events)
    if to_status is Status.CANCELED:
        return "task.canceled" if "CANCELED" in wanted else None
    if to_status is Status.PROCESSING and "PROGRESS" in wanted:
        return PROGRESS_TYPE
    return None


def _iso(value: datetime | None) -> str | None:
    return value.astimezone(UTC).isoformat().replace("+00:00", "Z") if value is not None else None


def webhook_id(task_id: int, version: int) -> str:
    """The Standard Webhooks message id of one event's webhook: the same on every attempt and redelivery."""
    return f"msg_{task_id}_{version}"


def payload(row: Mapping[str, Any], kind: str) -> dict[str, Any]:
    """The JSON body of a webhook, from a relay row (task_event joined with its task)."""
    status = Status(row["to_status"])
    result = None
    if row["result_uri"]:
        result = {
            "uri": row["result_uri"],
            "size": row["result_size"],
            "sha256": row["result_sha256"],
            "content_type": row["result_content_type"],
            "reused": bool(row["task_result_reused"]),
        }
    error = {"code": row["error_code"], "message": row["error_msg"] or ""} if row["error_code"] else None
    terminal = status.terminal
    return {
        "type": kind,
        "timestamp": _iso(row["at"]),
        "data": {
            "task_id": str(row["task_id"]),
            "status": status.value,
            "version": row["version"],
            "progress": row["progress"],
            "attempt": row["attempt"],
            "model_id": row["model_id"],
            "result": result,
            "error": error if status in (Status.FAILED, Status.TIMEOUT) else None,
            "metadata": row["task_metadata"] or {},
            "created_at": _iso(row["task_created_at"]),
            "queued_at": _iso(row["task_queued_at"]),
            "started_at": _iso(row["task_started_at"]),
            "finished_at": _iso(row["task_finished_at"]) if terminal else None,
            "event_at": _iso(row["at"]),
        },
    }


def plan(row: Mapping[str, Any]) -> Delivery | None:
    """The delivery one relayed event creates, if its task has a callback URL and the event qualifies."""
    url = row["callback_url"]
    if not url:
        return None
    kind = event_type(Status(row["to_status"]), row["callback_events"])
    if kind is None:
        return None
    return Delivery(
        task_id=row["task_id"],
        event_id=row["id"],
        user_id=row["user_id"],
        webhook_id=webhook_id(row["task_id"], row["version"]),
        event_type=kind,
        url=url,
        payload=payload(row, kind),
    )


async def write(conn: asyncpg.Connection, rows: Sequence[Mapping[str, Any]], first_delay: float) -> int:
    """Inserts the deliveries of a relay batch (idempotent) and marks terminal tasks that get none; returns how many."""
    deliveries = [d for d in (plan(r) for r in rows) if d is not None]
    if deliveries:
        await conn.executemany(
            sql.query("outbox_insert_delivery"),
            [(d.task_id, d.event_id, d.user_id, d.webhook_id, d.event_type, d.url, d.payload, first_delay) for d in deliveries],
        )
    with_webhook = {d.task_id for d in deliveries if d.event_type != PROGRESS_TYPE}
    silent = [
        r["task_id"]
        for r in rows
        if r["callback_url"] and Status(r["to_status"]).terminal and r["task_id"] not in with_webhook
    ]
    if silent:
        await conn.execute(sql.query("outbox_callback_none"), silent)
    return len(deliveries)

__all__ = ["redeliver"]
