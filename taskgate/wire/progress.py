"""TaskProgress: a running task's progress at each step, from its worker to the notifiers' WatchTask streams on core
NATS (`taskgate.live.progress.<tenant>.<task>`), with no PostgreSQL write.

Live and lossy by design: no version, no history row, no webhook, no resume. A message lost (no notifier listening,
a reconnect) is superseded by the next step's; PostgreSQL keeps the newest every `progress_interval_seconds` (the
heartbeat's statement, a `progress` event with its history row, relay message and webhooks), and every state change
as before.
"""

from __future__ import annotations

import logging

from nats.aio.msg import Msg
from nats.errors import Error as NatsError

from taskgate import bus as busmod
from taskgate_api.v1 import task_pb2

log = logging.getLogger("taskgate.progress")

SUBJECTS = busmod.PROGRESS_SUBJECTS


def message(task_id: int, attempt: int, percent: int, step: int, total: int) -> task_pb2.TaskProgress:
    """The message for one step, stamped now."""
    msg = task_pb2.TaskProgress(task_id=str(task_id), attempt=attempt, progress=percent, step=step, total_steps=total)
    msg.at.GetCurrentTime()
    return msg


async def publish(bus: busmod.Bus, user_id: str, progress: task_pb2.TaskProgress) -> bool:
    """Sends one step's progress; False when it could not be sent (the next step's supersedes it). Never raises for
    NATS."""
    try:
        await bus.nc.publish(busmod.progress_subject(user_id, int(progress.task_id)), progress.SerializeToString())
    except (NatsError, OSError) as exc:
        log.debug("progress not sent", extra={"task_id": progress.task_id, "error": type(exc).__name__})
        return False
    return True


def decode(msg: Msg, task_id: int) -> task_pb2.TaskProgress | None:
    """The progress a message carries for `task_id` (the subject's); None when it is not one."""
    try:
        progress = task_pb2.TaskProgress.FromString(msg.data)
    except Exception:  # protobuf raises DecodeError and, on some inputs, other errors
        return None
    return progress if progress.task_id == str(task_id) and progress.attempt > 0 else None
