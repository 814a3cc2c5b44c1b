"""TaskEvent: one version of one task on the TASK_EVENTS stream, its subject, and its Nats-Msg-Id.

The relay publishes each task_event row once per version (`<task>.v<version>`), so JetStream drops a replayed publish
of the same version; the streams send the same message from the table when the live feed missed it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from taskgate import bus as busmod
from taskgate import ids
from taskgate.model import timestamp
from taskgate.states import Status
from taskgate.store.events import Event
from taskgate_api.v1 import task_pb2


def message(event: Event) -> task_pb2.TaskEvent:
    """One history row as a TaskEvent."""
    msg = task_pb2.TaskEvent(
        task_id=str(event.task_id),
        user_id=event.user_id,
        model_id=event.model_id,
        version=event.version,
        to_status=event.to_status.to_proto(),
        progress=event.progress,
        error_code=event.error_code or "",
        error_message=event.error_msg or "",
        attempt=event.attempt,
        worker_id=event.worker_id or "",
        reason=event.reason or "",
        actor=event.actor,
        event_id=event.id,
        end_user=event.end_user,
    )
    if event.from_status is not None:
        msg.from_status = event.from_status.to_proto()
    msg.at.CopyFrom(timestamp(event.at))
    if event.result_uri:
        msg.result.CopyFrom(
            task_pb2.TaskResult(
                uri=event.result_uri,
                content_type=event.result_content_type or "",
                size_bytes=event.result_size or 0,
                sha256=event.result_sha256 or "",
            )
        )
    return msg


def msg_id(event: Event) -> str:
    """The JetStream dedup id of one event: a replayed publish of the same version is dropped."""
    return f"{event.task_id}.v{event.version}"


async def publish_async(
    bus: busmod.Bus, event: Event, *, trace_context: Mapping[str, str] | None = None
) -> asyncio.Future[Any] | None:
    """Publishes without waiting for the ack (the future resolves with it); None when the event has no valid subject.
    `trace_context` (the relay span's) rides in the headers.

    No stall timeout here: nats-py waits for room with `wait_for(..., wait_stall)`, which yields to the loop on every
    message, so its flusher ran between any two publishes and each message cost a socket write of its own (43% of the
    notifier's CPU in a bulk run). Without it a pass's messages leave in one write; the caller bounds the whole pass
    (EventRelay wraps its publishes in one asyncio.timeout)."""
    try:
        subject = busmod.event_subject(event.user_id, event.task_id)
    except ValueError:
        return None
    return await bus.js.publish_async(
        subject,
        message(event).SerializeToString(),
        wait_stall=None,
        headers={"Nats-Msg-Id": msg_id(event), **(trace_context or {})},
    )


def decode(data: bytes) -> task_pb2.TaskEvent | None:
    """The event a stream message carries, or None when it is not a valid one."""
    try:
        event = task_pb2.TaskEvent.FromString(data)
    except Exception:  # protobuf raises DecodeError and, on some inputs, other errors
        return None
    return event if ids.parse(event.task_id) is not None else None


def is_terminal(event: task_pb2.TaskEvent) -> bool:
    """Whether the event moved its task into a terminal state."""
    return Status.from_proto(event.to_status).terminal if event.to_status else False
