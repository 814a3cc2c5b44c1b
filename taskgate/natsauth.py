"""NATS users, one per service, each allowed only the subjects that service sends and reads (least privilege inside).

A worker's credentials cannot publish task events, purge a stream or read another service's traffic; the notifier
alone publishes `taskgate.events.>` (a small statement's events reach its WatchTask streams sooner by PostgreSQL's
NOTIFY on commit, not over NATS; workers send running tasks' progress on `taskgate.live.progress.>`, which the notifier
passes to the task's streams only); only the `admin` user (the migrate
step, operators) may create, change or purge streams. `python -m taskgate.natsauth` prints nats-server's `authorization`
block, each password read from the server's environment (`$TASKGATE_NATS_<ROLE>_PASSWORD`).

JetStream's API is subjects too (`$JS.API.<operation>.<stream>...`), so each role lists the API calls it makes.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from taskgate import bus

REPLIES = "_INBOX.>"  # request replies and push deliveries (nats-py's inbox prefix)
TASKS = bus.TASKS_STREAM
EVENTS = bus.EVENTS_STREAM
OUTPUT = bus.OUTPUT_STREAM
OBJECTS = f"OBJ_{bus.RESULTS_BUCKET}"  # the results bucket's stream


@dataclass(frozen=True)
class Permissions:
    """Subjects one NATS user may publish to and subscribe to."""

    publish: tuple[str, ...]
    subscribe: tuple[str, ...] = (REPLIES,)


# Reading an output back: its description, then its chunks, one direct get each (taskgate.results).
RESULTS_READ = (
    "$JS.API.STREAM.NAMES",  # nats-py finds the bucket's stream by a chunk's subject
    f"$JS.API.STREAM.INFO.{OBJECTS}",
    f"$JS.API.STREAM.MSG.GET.{OBJECTS}",
    f"$JS.API.DIRECT.GET.{OBJECTS}",  # the next chunk after a sequence
    f"$JS.API.DIRECT.GET.{OBJECTS}.>",  # the last description by its subject
)
# Storing (or deleting) an output: chunks, then its meta; an overwrite or a delete purges the old chunks.
RESULTS_WRITE = (f"$O.{bus.RESULTS_BUCKET}.>", f"$JS.API.STREAM.PURGE.{OBJECTS}", *RESULTS_READ)

ROLES: Mapping[str, Permissions] = {
    # dispatches tasks, hints cancels, stores input images, reads outputs back
    "submit": Permissions(
        publish=(
            bus.TASK_SUBJECTS,
            bus.CANCEL_SUBJECT,
            f"$JS.API.STREAM.INFO.{TASKS}",
            *RESULTS_WRITE,
        )
    ),
    # re-dispatches, dead-letters, hints cancels and preemptions, reads queue depths, deletes expired outputs
    "scheduler": Permissions(
        publish=(
            bus.TASK_SUBJECTS,
            bus.DEAD_SUBJECTS,
            bus.CANCEL_SUBJECT,
            bus.PREEMPT_SUBJECT,
            f"$JS.API.STREAM.INFO.{TASKS}",
            f"$JS.API.CONSUMER.INFO.{TASKS}.>",
            f"$JS.API.CONSUMER.LIST.{TASKS}",
            *RESULTS_WRITE,
        ),
    ),
    # pulls its models' dispatches and acks them, stores outputs, reads inputs, dead-letters; hears cancel and
    # preemption hints
    "worker": Permissions(
        publish=(
            f"$JS.API.CONSUMER.MSG.NEXT.{TASKS}.>",
            f"$JS.ACK.{TASKS}.>",
            f"$JS.API.CONSUMER.INFO.{TASKS}.>",
            f"$JS.API.CONSUMER.CREATE.{TASKS}.>",
            f"$JS.API.CONSUMER.DURABLE.CREATE.{TASKS}.>",
            f"$JS.API.STREAM.INFO.{TASKS}",
            bus.DEAD_SUBJECTS,
            bus.OUTPUT_SUBJECTS,
            *RESULTS_WRITE,
            f"$JS.API.STREAM.INFO.{OUTPUT}",
            f"$JS.API.CONSUMER.CREATE.{OUTPUT}",
            f"$JS.API.CONSUMER.CREATE.{OUTPUT}.>",
            f"$JS.API.CONSUMER.DELETE.{OUTPUT}.>",
            f"$JS.FC.{OUTPUT}.>",
            bus.PROGRESS_SUBJECTS,
        ),
        subscribe=(REPLIES, bus.CANCEL_SUBJECT, bus.PREEMPT_SUBJECT),
    ),
    # relays task events (their only publisher) and follows them for the streams; links outputs
    "notifier": Permissions(
        publish=(
            bus.EVENT_SUBJECTS,
            f"$JS.API.STREAM.INFO.{EVENTS}",
            f"$JS.API.CONSUMER.CREATE.{EVENTS}",
            f"$JS.API.CONSUMER.CREATE.{EVENTS}.>",
            f"$JS.API.CONSUMER.DELETE.{EVENTS}.>",
            f"$JS.API.CONSUMER.INFO.{EVENTS}.>",
            f"$JS.FC.{EVENTS}.>",
            *RESULTS_READ,
            f"$JS.API.STREAM.INFO.{OUTPUT}",
            f"$JS.API.CONSUMER.CREATE.{OUTPUT}",
            f"$JS.API.CONSUMER.CREATE.{OUTPUT}.>",
            f"$JS.API.CONSUMER.DELETE.{OUTPUT}.>",
            f"$JS.API.CONSUMER.INFO.{OUTPUT}.>",
            f"$JS.FC.{OUTPUT}.>",
            f"$JS.API.DIRECT.GET.{OUTPUT}",
            f"$JS.API.DIRECT.GET.{OUTPUT}.>",
            f"$JS.API.STREAM.MSG.GET.{OUTPUT}",
        ),
        # the committers' hints of terminal versions, stored output chunks republished live, running tasks' progress
        # (core subjects)
        subscribe=(REPLIES, bus.OUTPUT_LIVE_SUBJECTS, bus.PROGRESS_SUBJECTS),
    ),
    # the migrate step and operators: streams, consumers and buckets declared, changed or purged
    "admin": Permissions(publish=(">",), subscribe=(">",)),
}


def password_variable(role: str) -> str:
    """The environment variable nats-server reads `role`'s password from."""
    return f"TASKGATE_NATS_{role.upper()}_PASSWORD"


def authorization(passwords: Mapping[str, str] | None = None) -> str:
    """nats-server's `authorization` block for every role: each password as given, else `$<password_variable>`."""
    users = []
    for role, perms in ROLES.items():
        secret = json.dumps(passwords[role]) if passwords is not None else f"${password_variable(role)}"
        publish = ", ".join(json.dumps(s) for s in perms.publish)
        subscribe = ", ".join(json.dumps(s) for s in perms.subscribe)
        users.append(
            f"    {{user: {json.dumps(role)}, password: {secret},\n"
            f"     permissions: {{publish: {{allow: [{publish}]}}, subscribe: {{allow: [{subscribe}]}}}}}}"
        )
    return "authorization {\n  users: [\n" + ",\n".join(users) + "\n  ]\n}\n"


def main() -> None:
    """`python -m taskgate.natsauth`: prints the authorization block to include in nats-server's configuration."""
    sys.stdout.write(authorization())


if __name__ == "__main__":
    main()
