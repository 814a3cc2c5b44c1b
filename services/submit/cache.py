"""A bounded in-process cache of terminal tasks, which no longer change."""

from __future__ import annotations

from collections import OrderedDict

from taskgate.model import TaskRow


def cacheable(task: TaskRow) -> bool:
    """Terminal and with no webhook still in flight (callback_status changes after the task finished)."""
    return task.status.terminal and task.callback_status != "PENDING"


class TerminalCache:
    """Least-recently-used map of task id to a finished task row; size 0 disables it."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._rows: OrderedDict[int, TaskRow] = OrderedDict()

    def get(self, task_id: int) -> TaskRow | None:
        row = self._rows.get(task_id)
        if row is not None:
            self._rows.move_to_end(task_id)
        return row

    def put(self, task: TaskRow) -> None:
        if self._size == 0 or not cacheable(task):
            return
        self._rows[task.id] = task
        self._rows.move_to_end(task.id)
        while len(self._rows) > self._size:
            self._rows.popitem(last=False)

    def __len__(self) -> int:
        return len(self._rows)
