"""TaskProgress: running tasks' progress at each step, from their worker to the notifiers' WatchTask streams on core
NATS (`taskgate.live.progress.<tenant>`), with no PostgreSQL write.

One message carries the newest step of each of one tenant's tasks that moved since the worker's last publish (at most
one message per tenant per `live_progress_tick_seconds` from each worker; services/worker/live.py): the body is the
TaskProgress messages one after another, each preceded by its length as a protobuf varint (the "length-delimited"
framing). A fleet of running tasks costs NATS a message per tenant per tick, not one per task per step.

Live and lossy by design: no version, no history row, no webhook, no resume. A message lost (no notifier listening,
a reconnect) is superseded by the next step's; PostgreSQL keeps the newest every `progress_interval_seconds` (the
heartbeat's statement, a `progress` event with its history row, relay message and webhooks), and every state change
as before.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from google.protobuf.timestamp_pb2 import Timestamp
from nats.errors import Error as NatsError

from taskgate import bus as busmod
from taskgate_api.v1 import task_pb2

log = logging.getLogger("taskgate.progress")

SUBJECTS = busmod.PROGRESS_SUBJECTS
MAX_ITEM_BYTES = 1 << 16  # far above a TaskProgress's size: a longer length says the body is not ours


def message(
    task_id: int, attempt: int, percent: int, step: int, total: int, at: Timestamp | None = None
) -> task_pb2.TaskProgress:
    """The message for one step, stamped `at` (None: now)."""
    msg = task_pb2.TaskProgress(task_id=str(task_id), attempt=attempt, progress=percent, step=step, total_steps=total)
    msg.at.CopyFrom(at if at is not None else now())
    return msg


def now() -> Timestamp:
    """The time now as a Timestamp (Timestamp.GetCurrentTime goes through a datetime and a time tuple: 10 times
    slower, once per item of every pass)."""
    seconds, nanos = divmod(time.time_ns(), 1_000_000_000)
    return Timestamp(seconds=seconds, nanos=nanos)


def encode(items: Iterable[task_pb2.TaskProgress]) -> bytes:
    """One message's body: each item's length (a varint) then its bytes."""
    out = bytearray()
    for item in items:
        data = item.SerializeToString()
        size = len(data)
        while size >= 0x80:
            out.append((size & 0x7F) | 0x80)
            size >>= 7
        out.append(size)
        out += data
    return bytes(out)


def decode(data: bytes) -> list[task_pb2.TaskProgress] | None:
    """The items of a message's body; None when it is not one (a bad length, an undecodable or unnamed item)."""
    items: list[task_pb2.TaskProgress] = []
    at, end = 0, len(data)
    while at < end:
        size = shift = 0
        while True:
            if at >= end or shift > 14:
                return None
            byte = data[at]
            at += 1
            size |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                break
        if size > MAX_ITEM_BYTES or at + size > end:
            return None
        try:
            item = task_pb2.TaskProgress.FromString(data[at:at + size])
        except Exception:  # protobuf raises DecodeError and, on some inputs, other errors
            return None
        at += size
        if not item.task_id.isdigit() or item.attempt <= 0:
            return None
        items.append(item)
    return items


async def publish(bus: busmod.Bus, user_id: str, items: Iterable[task_pb2.TaskProgress]) -> bool:
    """Sends one tenant's steps in one message; False when it could not be sent (the next steps supersede them).
    Never raises for NATS."""
    try:
        await bus.nc.publish(busmod.progress_subject(user_id), encode(items))
    except (NatsError, OSError) as exc:
        log.debug("progress not sent", extra={"user_id": user_id, "error": type(exc).__name__})
        return False
    return True


def tenant_of(subject: str) -> str | None:
    """The tenant a progress subject names, or None when it is not one."""
    prefix = SUBJECTS[:-1]  # "taskgate.live.progress."
    if not subject.startswith(prefix):
        return None
    tenant = subject[len(prefix):]
    return tenant if tenant and "." not in tenant else None
