"""The callback outbox's planning: which relayed events become webhooks, and their JSON body."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import asyncpg

from taskgate import tracing
from taskgate.states import CallbackStatus, Status
from taskgate.store import webhooks as webhook_store
from taskgate.store.events import RelayEvent

TERMINAL_WITH_WEBHOOK = frozenset({Status.SUCCEEDED, Status.FAILED, Status.TIMEOUT})

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
        return webhook_store.PROGRESS_TYPE
    return None


def wants_output(callback_events: Sequence[str] | None) -> bool:
    """Whether the submitter opted in to task.output webhooks (services/notifier/output_hooks), never on by default."""
    return "OUTPUT" in _filters(callback_events)


def iso(value: datetime | None) -> str | None:
    """A timestamp as webhook payloads write it: UTC, ISO 8601, `Z`."""
    return value.astimezone(UTC).isoformat().replace("+00:00", "Z") if value is not None else None


def webhook_id(task_id: int, version: int) -> str:
    """The Standard Webhooks message id of one event's webhook: the same on every attempt and redelivery."""
    return f"msg_{task_id}_{version}"


def payload(row: RelayEvent, kind: str) -> dict[str, Any]:
    """The JSON body of a webhook, from a relayed event and its task."""
    event = row.event
    status = event.to_status
    result = None
    if event.result_uri:
        result = {
            "uri": event.result_uri,
            "size": event.result_size,
            "sha256": event.result_sha256,
            "content_type": event.result_content_type,
            "reused": row.result_reused,
        }
    error = {"code": event.error_code, "message": event.error_msg or ""} if event.error_code else None
    terminal = status.terminal
    return {
        "type": kind,
        "timestamp": iso(event.at),
        "data": {
            "task_id": str(event.task_id),
            "status": status.value,
            "version": event.version,
            "progress": event.progress,
            "attempt": event.attempt,
            "model_id": event.model_id,
            "end_user": event.end_user,  # '': the tenant itself
            "result": result,
            "error": error if status in (Status.FAILED, Status.TIMEOUT) else None,
            "metadata": row.metadata,
            "created_at": iso(row.created_at),
            "queued_at": iso(row.queued_at),
            "started_at": iso(row.started_at),
            "finished_at": iso(row.finished_at) if terminal else None,
            "usage": {
                "gpu_seconds": row.device_seconds, "slot_seconds": row.slot_seconds,
                "input_tokens": row.input_tokens, "output_tokens": row.output_tokens,
            } if terminal else None,
            "event_at": iso(event.at),
        },
    }


def plan(row: RelayEvent, trace_context: tracing.Carrier | None = None) -> webhook_store.NewDelivery | None:
    """The delivery one relayed event creates, if its task has a callback URL and the event qualifies; its webhook
    continues `trace_context` (the relay span's)."""
    url = row.callback_url
    if not url:
        return None
    event = row.event
    kind = event_type(event.to_status, row.callback_events)
    if kind is None:
        return None
    return webhook_store.NewDelivery(
        task_id=event.task_id,
        event_id=event.id,
        user_id=event.user_id,
        webhook_id=webhook_id(event.task_id, event.version),
        event_type=kind,
        url=url,
        payload=payload(row, kind),
        trace_context=trace_context,
    )


async def write(
    conn: asyncpg.Connection,
    rows: Sequence[RelayEvent],
    *,
    first_delay: float,
    traces: Sequence[tracing.Carrier | None] = (),
) -> int:
    """Inserts the deliveries of a relay batch (idempotent) and marks terminal tasks that get none; returns how many.
    `traces`: each row's relay-span context, when tracing is on."""
    contexts = list(traces) or [None] * len(rows)
    deliveries = [d for d in (plan(r, t) for r, t in zip(rows, contexts, strict=True)) if d is not None]
    if deliveries:
        await webhook_store.insert_deliveries(conn, deliveries, first_delay=first_delay)
    with_webhook = {d.task_id for d in deliveries if d.event_type != webhook_store.PROGRESS_TYPE}
    silent = [
        r.event.task_id
        for r in rows
        if r.callback_url and r.event.to_status.terminal and r.event.task_id not in with_webhook
    ]
    if silent:
        await webhook_store.move_status(conn, silent, to=CallbackStatus.NONE)
    return len(deliveries)
