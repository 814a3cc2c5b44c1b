"""A bounded in-process cache of terminal tasks, which no longer change — until they are deleted (a purge, retention)
or their output expires: then every replica forgets them on the NOTIFY `taskgate_task_forgotten`
(taskgate/sql/functions/task_forgotten.sql), and no entry outlives its age limit whatever was missed."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from taskgate.model import TaskRow

FORGOTTEN_CHANNEL = "taskgate_task_forgotten"  # NOTIFY payload: the id of a task deleted or whose output expired


def cacheable(task: TaskRow) -> bool:
    """Terminal and with no webhook still in flight (callback_status changes after the task finished)."""
    return task.status.terminal and task.callback_status != "PENDING"


class TerminalCache:
    """Least-recently-used map of task id to a finished task row, each kept at most `max_age` seconds; size 0
    disables it."""

    def __init__(self, size: int, max_age: float = 300.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._size = size
        self._max_age = max_age
        self._clock = clock
        self._rows: OrderedDict[int, tuple[float, TaskRow]] = OrderedDict()

    def get(self, task_id: int) -> TaskRow | None:
        held = self._rows.get(task_id)
        if held is None:
            return None
        if self._clock() - held[0] > self._max_age:
            del self._rows[task_id]
            return None
        self._rows.move_to_end(task_id)
        return held[1]

    def put(self, task: TaskRow) -> None:
        if self._size == 0 or not cacheable(task):
            return
        self._rows[task.id] = (self._clock(), task)
        self._rows.move_to_end(task.id)
        while len(self._rows) > self._size:
            self._rows.popitem(last=False)

    def forget(self, payload: str | None) -> None:
        """A listener's handler: a task id from the NOTIFY goes; None (the listen connection was (re)made, so some
        notifications may have been missed) or a payload that is no id empties the cache."""
        if payload is not None and payload.isascii() and payload.isdigit():
            self._rows.pop(int(payload), None)
        else:
            self._rows.clear()

    def __len__(self) -> int:
        return len(self._rows)
