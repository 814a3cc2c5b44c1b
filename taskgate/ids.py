"""64-bit time-ordered ids: 41 bits of milliseconds since 2024-01-01, 10 bits of node, 12 bits of sequence."""

from __future__ import annotations

import os
import random
import threading
import time

from taskgate import errors

EPOCH_MS = 1_704_067_200_000
_NODE_BITS = 10
_SEQ_BITS = 12


class IdGenerator:
    """Monotonic within a process; distinct across processes by a random node number."""

    def __init__(self, node: int | None = None) -> None:
        self._node = (node if node is not None else random.SystemRandom().getrandbits(_NODE_BITS)) & ((1 << _NODE_BITS) - 1)
        self._lock = threading.Lock()
        self._last_ms = 0
        self._seq = 0

    def next(self) -> int:
        with self._lock:
            now = int(time.time() * 1000) - EPOCH_MS
            if now <= self._last_ms:
                now = self._last_ms
                self._seq = (self._seq + 1) & ((1 << _SEQ_BITS) - 1)
                if self._seq == 0:
                    now += 1  # sequence exhausted: borrow the next millisecond
            else:
                self._seq = 0
            self._last_ms = now
            return (now << (_NODE_BITS + _SEQ_BITS)) | (self._node << _SEQ_BITS) | self._seq


_default: IdGenerator | None = None
_default_pid = 0


def new_id() -> int:
    """A fresh task id (re-seeded after fork)."""
    global _default, _default_pid
    if _default is None or _default_pid != os.getpid():
        _default, _default_pid = IdGenerator(), os.getpid()
    return _default.next()


MAX_ID = 2**63 - 1


def parse(text: str) -> int | None:
    """The task id a decimal string names (1 to 2**63 - 1, ASCII digits only), or None: the one rule for every reader."""
    if not text or len(text) > 19 or not text.isascii() or not text.isdigit():
        return None
    value = int(text)
    return value if 0 < value <= MAX_ID else None


def require(text: str, field: str = "task_id") -> int:
    """The task id of a request field, or INVALID_ARGUMENT naming the field."""
    value = parse(text)
    if value is None:
        raise errors.invalid_argument([(field, "must be a decimal task id")])
    return value


def timestamp_ms(task_id: int) -> int:
    """Unix milliseconds at which an id was made."""
    return (task_id >> (_NODE_BITS + _SEQ_BITS)) + EPOCH_MS
