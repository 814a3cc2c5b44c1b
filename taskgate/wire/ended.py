"""TaskEnded: a core-NATS hint, sent by the process that committed a task's terminal version, that the notifiers'
WatchTask streams of that task can read it now.

The subject says it all (`taskgate.control.ended.<task>.<version>`, no payload): a notifier with a stream of that task
reads that version's event row from PostgreSQL and hands it to the stream at once, rather than waiting for the relay's
pass and the JetStream feed. The hint carries no event, so whoever may send it can forge nothing (events stay the
relay's to publish); a lost hint costs only the relay's latency, and a stream drops the relay's copy by its version.
"""

from __future__ import annotations

import logging

from nats.errors import Error as NatsError

from taskgate import bus as busmod
from taskgate.model import TaskRow

log = logging.getLogger("taskgate.ended")

SUBJECTS = busmod.ENDED_SUBJECTS
_PREFIX = SUBJECTS[:-1]  # "taskgate.control.ended."


def parse(subject: str) -> tuple[int, int] | None:
    """(task id, version) of a hint's subject, or None when it is not one."""
    if not subject.startswith(_PREFIX):
        return None
    parts = subject[len(_PREFIX):].split(".")
    if len(parts) != 2 or not all(p.isascii() and p.isdigit() and len(p) <= 19 for p in parts):
        return None
    task_id, version = int(parts[0]), int(parts[1])
    return (task_id, version) if 0 < task_id < 2**63 and 0 < version < 2**31 else None


async def send(bus: busmod.Bus, task: TaskRow | None) -> None:
    """Hints a task's terminal version to the notifiers; nothing for a task that is not terminal. Never raises: the
    relay delivers the event anyway."""
    if task is None or not task.status.terminal:
        return
    try:
        await bus.nc.publish(busmod.ended_subject(task.id, task.version))
    except (NatsError, OSError) as exc:
        log.debug("ended hint not sent", extra={"task_id": str(task.id), "error": type(exc).__name__})
