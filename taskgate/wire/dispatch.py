"""TaskDispatch: the hint that a task is ready to run, its subject, and its Nats-Msg-Id scheme.

JetStream drops a second publish with the same Nats-Msg-Id inside the duplicate window, so the id names *which*
dispatch this is: the submit's first (`q0`), a scheduler re-publish (`p<version>`), or the one after a released
attempt (`a<attempt>`). The same id is reused when the same dispatch is retried; a new dispatch gets a new id.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from typing import Any

import nats.errors
import nats.js.errors
from opentelemetry.trace import SpanKind

from taskgate import bus as busmod
from taskgate import ids, tracing
from taskgate.model import TaskRow
from taskgate.waiting import cancelling
from taskgate_api.v1 import task_pb2

log = logging.getLogger("taskgate.dispatch")


class Reason(enum.Enum):
    """Why a task is (re-)dispatched; decides its message id."""

    SUBMITTED = "submitted"  # the submit's own publish, or the scheduler re-sending a CREATED task's lost one
    REPUBLISHED = "republished"  # QUEUED too long: sent again, a new message
    RELEASED = "released"  # back in the queue after an attempt ended without a result


def msg_id(task: TaskRow, reason: Reason) -> str:
    """The Nats-Msg-Id of one dispatch of `task` (as the row is before the move that goes with it)."""
    if reason is Reason.SUBMITTED:
        return f"{task.id}.q0"
    if reason is Reason.REPUBLISHED:
        return f"{task.id}.p{task.version + 1}"  # the version after the bump never repeats
    return f"{task.id}.a{task.attempt}"


def encode(task: TaskRow) -> bytes:
    """The TaskDispatch payload of a task."""
    return encode_fields(task.id, task.model_id, task.priority)


def encode_fields(task_id: int | str, model_id: str, priority: int) -> bytes:
    """The TaskDispatch payload from its fields (also for tests that send malformed ids on purpose)."""
    return task_pb2.TaskDispatch(
        task_id=str(task_id),
        model_id=model_id,
        priority=priority,  # type: ignore[arg-type]
        published_at_unix_ms=int(time.time() * 1000),
    ).SerializeToString()


def task_id_of(data: bytes) -> int | None:
    """The task id a dispatch message names, or None when it is not one (poison is dropped, not retried)."""
    try:
        text = task_pb2.TaskDispatch.FromString(data).task_id
    except Exception:  # protobuf raises DecodeError and, on some inputs, other errors
        return None
    return ids.parse(text)


async def publish(bus: busmod.Bus, task: TaskRow, reason: Reason, *, ack_timeout: float | None = None) -> None:
    """Publishes one dispatch and waits for JetStream's ack (raises on failure); a span of the task's trace, whose
    context the message's headers carry to the worker that claims it."""
    with tracing.span(**_span_of(task, reason)):
        await bus.js.publish(
            busmod.task_subject(task.model_id, task.priority), encode(task), timeout=ack_timeout,
            headers=tracing.headers({"Nats-Msg-Id": msg_id(task, reason)}),
        )


async def publish_many(
    bus: busmod.Bus, items: list[tuple[TaskRow, Reason]], *, ack_timeout: float | None = None
) -> list[tuple[TaskRow, Reason]]:
    """Publishes with every ack awaited at once (pipelined); returns the items acknowledged (failures are logged).

    The messages leave in one write and their acks are futures, not a task and a timer per message (publish_async
    without its per-message stall wait, as the relay does); `ack_timeout` bounds the whole batch. Each message is a
    span of its task's trace, as with `publish`.
    """
    spans = [tracing.start(**_span_of(task, reason)) for task, reason in items] if tracing.enabled() else []
    futures: list[asyncio.Future[Any]] = []
    try:
        async with asyncio.timeout(ack_timeout):
            for i, (task, reason) in enumerate(items):
                headers = {
                    "Nats-Msg-Id": msg_id(task, reason),
                    **((tracing.carrier_of(spans[i]) or {}) if spans else {}),
                }
                futures.append(await bus.js.publish_async(
                    busmod.task_subject(task.model_id, task.priority), encode(task), wait_stall=None, headers=headers
                ))
            if futures:
                await asyncio.wait(futures)
    except TimeoutError:
        pass  # what was acknowledged in time counts; the rest is reported below
    except (nats.errors.Error, nats.js.errors.Error) as exc:
        if cancelling():  # nats-py turns a cancellation into an error of its own
            _abandon(futures, spans)
            raise asyncio.CancelledError from exc
        log.warning("dispatch publish failed", extra={"tasks": len(items) - len(futures), "error": type(exc).__name__})
    except asyncio.CancelledError:
        _abandon(futures, spans)
        raise
    done = []
    for i, (task, reason) in enumerate(items):
        fut = futures[i] if i < len(futures) else None
        error = None
        if fut is None or not fut.done():
            error = "TimeoutError" if fut is not None else "not published"
        elif fut.cancelled():  # the client gave up on it (a closed connection)
            error = "CancelledError"
        elif fut.exception() is not None:
            error = type(fut.exception()).__name__
        if spans:
            tracing.end(spans[i], error=error)
        if error is None:
            done.append((task, reason))
        elif fut is not None:
            log.warning("dispatch publish failed", extra={"task_id": str(task.id), "error": error})
    _abandon(futures, [])
    return done


def _abandon(futures: list[asyncio.Future[Any]], spans: list[Any]) -> None:
    """Stops awaiting acks still outstanding (JetStream keeps a message that lands anyway); ends unended spans."""
    for fut in futures:
        fut.cancel()
    for started in spans:
        tracing.end(started, error="cancelled")


def _span_of(task: TaskRow, reason: Reason) -> dict[str, Any]:
    """The dispatch span of one message, a child of its task's trace (tracing.span / tracing.start arguments)."""
    subject = busmod.task_subject(task.model_id, task.priority)
    return {
        "name": f"dispatch {reason.value}",
        "parent": task.trace_context,
        "kind": SpanKind.PRODUCER,
        "attributes": {
            tracing.TASK_ID: str(task.id),
            "messaging.system": "nats",
            "messaging.destination.name": subject,
        },
    }
