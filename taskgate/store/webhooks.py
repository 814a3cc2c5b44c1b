"""The webhook outbox: deliveries to send, their attempts, and the task's view of its terminal webhook.

Every write of task.callback_status is `move_status`, guarded by states.CALLBACK_LEGAL: a move the table does not list
matches no row. Several notifier replicas share the outbox by lease; a redelivery wakes them all at commit.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import asyncpg

from taskgate import sql
from taskgate.states import CALLBACK_LEGAL, CallbackStatus
from taskgate.store.pool import Conn

log = logging.getLogger("taskgate.callbacks")

PROGRESS_TYPE = "task.progress"  # the one event type that is not the task's terminal webhook


def sources(target: CallbackStatus) -> list[CallbackStatus]:
    """The callback states from which `target` may be entered."""
    return [src for src, dests in CALLBACK_LEGAL.items() if target in dests]


async def move_status(
    db: Conn, task_ids: Sequence[int], *, to: CallbackStatus, retries: int | None = None
) -> list[int]:
    """Moves tasks (with a callback URL) to `to` where the table allows it from their status; the ids that moved.

    `retries` also records callback_retry (the failed attempts of the current round).
    """
    rows = await db.fetch(
        sql.query("callback_move_status"), list(task_ids), to.value, [s.value for s in sources(to)], retries
    )
    moved = [r["id"] for r in rows]
    if len(moved) < len(task_ids):
        refused = sorted(set(task_ids) - set(moved))
        log.warning("callback status move refused", extra={"to": to.value, "task_ids": [str(t) for t in refused][:20]})
    return moved


@dataclass(frozen=True, slots=True)
class NewDelivery:
    """A webhook to insert into the outbox for one event."""

    task_id: int
    event_id: int
    user_id: str
    webhook_id: str
    event_type: str
    url: str
    payload: dict[str, Any]
    trace_context: dict[str, str] | None = None  # the relay span's: the webhook's span continues it


@dataclass(frozen=True, slots=True)
class LeasedWebhook:
    """An outbox row this sender holds the lease of: one webhook to send now."""

    id: int
    task_id: int
    user_id: str
    webhook_id: str
    event_type: str
    url: str
    payload: dict[str, Any]
    attempts: int  # made so far, over every round
    round_start: int  # `attempts` when the current round (the first, or a redelivery) began
    created_at: datetime
    destination: str  # scheme://host:port of the url: what the per-destination cap and the breaker count by
    trace_context: dict[str, str] | None = None


@dataclass(frozen=True, slots=True)
class AttemptOutcome:
    """What one attempt came to, and what the delivery does next."""

    status: CallbackStatus  # the delivery's status after it: PENDING (retry later), DELIVERED or FAILED
    delay_seconds: float  # until the next attempt, when PENDING
    status_code: int | None
    latency_ms: float
    error: str | None


@dataclass(frozen=True, slots=True)
class Redelivery:
    """A delivery reset for a new round by a redelivery."""

    id: int
    webhook_id: str
    event_type: str
    status: CallbackStatus
    attempts: int


async def insert_deliveries(db: Conn, deliveries: Sequence[NewDelivery], *, first_delay: float) -> None:
    """Adds deliveries (idempotent per event and url), the first attempt due after `first_delay` seconds."""
    bound = [
        sql.bind(
            "outbox_insert_delivery",
            task_id=d.task_id,
            event_id=d.event_id,
            user_id=d.user_id,
            webhook_id=d.webhook_id,
            event_type=d.event_type,
            url=d.url,
            payload=d.payload,
            first_delay=first_delay,
            trace_context=d.trace_context,
        )
        for d in deliveries
    ]
    if bound:  # one statement, each delivery's arguments
        await db.executemany(bound[0][0], [args for _, *args in bound])


@dataclass(frozen=True, slots=True)
class Fairness:
    """How the sender shares itself among destinations: a cap in flight per destination, and a circuit breaker that
    opens after `breaker_failures` consecutive failures for `breaker_seconds`, then lets one attempt through."""

    per_destination: int
    breaker_failures: int
    breaker_seconds: float


async def claim_due(
    db: Conn, *, limit: int, owner: str, lease_seconds: float, progress: bool, fairness: Fairness
) -> list[LeasedWebhook]:
    """Due deliveries of one lane (progress webhooks, or the terminal ones), round-robin across destinations under
    their caps and breakers, leased to `owner` so no other sender sends them meanwhile; at most `limit`."""
    rows = await db.fetch(
        *sql.bind(
            "webhook_claim",
            limit=limit,
            owner=owner,
            lease_seconds=lease_seconds,
            progress=progress,
            per_destination=fairness.per_destination,
            breaker_failures=fairness.breaker_failures,
        )
    )
    return [
        LeasedWebhook(
            id=r["id"],
            task_id=r["task_id"],
            user_id=r["user_id"],
            webhook_id=r["webhook_id"],
            event_type=r["event_type"],
            url=r["url"],
            payload=r["payload"],
            attempts=r["attempts"],
            round_start=r["round_start"],
            created_at=r["created_at"],
            destination=r["destination"],
            trace_context=r["trace_context"],
        )
        for r in rows
    ]


async def destination_answered(db: Conn, destination: str) -> None:
    """The destination answered an attempt (anything but a 5xx): its breaker closes."""
    await db.execute(sql.query("webhook_breaker_closed"), destination)


async def destination_failed(db: Conn, destination: str, fairness: Fairness) -> datetime | None:
    """The destination failed an attempt (a 5xx, a timeout, no answer): counted; when the breaker opens, the time it
    stays open until (its waiting deliveries are put off to then), else None."""
    opened: datetime | None = await db.fetchval(
        sql.query("webhook_breaker_failed"), destination, fairness.breaker_failures, fairness.breaker_seconds
    )
    return opened


async def seconds_to_next_due(db: Conn) -> float | None:
    """Seconds until the next pending delivery is due (None when none is pending)."""
    value = await db.fetchval(sql.query("webhook_next_due"))
    return float(value) if value is not None else None


async def record(db: Conn, delivery: LeasedWebhook, *, owner: str, outcome: AttemptOutcome) -> bool:
    """Writes the outcome under the lease, the attempt's log row and the task's callback status, in one transaction.

    False when the lease was lost (expired, or the row was redelivered and taken by another sender): nothing written.
    """
    if isinstance(db, asyncpg.Pool):
        async with db.acquire() as conn:
            return await record(conn, delivery, owner=owner, outcome=outcome)
    async with db.transaction():
        done = await db.fetchrow(
            *sql.bind(
                "webhook_record",
                delivery_id=delivery.id,
                owner=owner,
                status=outcome.status.value,
                delay_seconds=outcome.delay_seconds,
                status_code=outcome.status_code,
                error=outcome.error,
            )
        )
        if done is None:
            return False
        await db.execute(
            *sql.bind(
                "webhook_insert_attempt",
                delivery_id=delivery.id,
                attempt=delivery.attempts + 1,
                webhook_id=delivery.webhook_id,
                status_code=outcome.status_code,
                latency_ms=outcome.latency_ms,
                error=outcome.error,
            )
        )
        if delivery.event_type != PROGRESS_TYPE:
            retries = done["attempts"] - done["round_start"] - 1
            await move_status(db, [delivery.task_id], to=outcome.status, retries=retries)
    return True


async def redeliver(db: Conn, task_id: int, *, include_progress: bool = False) -> list[Redelivery]:
    """Sends a task's terminal webhook(s) again with the same webhook-id, on a fresh round of the retry schedule.

    Returns the reset deliveries, oldest first; empty when the task has none (no callback URL, not terminal yet, or
    no such task). A lease in flight is kept, so no second sender sends the same delivery meanwhile. Every notifier
    is woken through NOTIFY 'taskgate_webhook' at commit, so the first attempt goes out at once.
    """
    if isinstance(db, asyncpg.Pool):
        async with db.acquire() as conn:
            return await redeliver(conn, task_id, include_progress=include_progress)
    async with db.transaction():
        rows = await db.fetch(sql.query("outbox_redeliver"), task_id, include_progress)
        out = [
            Redelivery(
                id=r["id"],
                webhook_id=r["webhook_id"],
                event_type=r["event_type"],
                status=CallbackStatus(r["status"]),
                attempts=r["attempts"],
            )
            for r in rows
        ]
        if any(d.event_type != PROGRESS_TYPE for d in out):
            await move_status(db, [task_id], to=CallbackStatus.PENDING)
        if out:
            await db.execute(sql.query("outbox_wake"), str(task_id))
    return out
