"""64-bit time-ordered ids: 41 bits of milliseconds since 2024-01-01, 10 bits of node, 12 bits of sequence.

A service makes ids with `LeasedIds`: its node number is leased in PostgreSQL, so no two live processes share one.
`new_id()` (tests, tools) takes a random node number.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import secrets
import socket
import threading
import time

import asyncpg

from taskgate import errors, loops
from taskgate.store import nodes

log = logging.getLogger("taskgate.ids")

EPOCH_MS = 1_704_067_200_000
_NODE_BITS = 10
_SEQ_BITS = 12


class IdGenerator:
    """Monotonic within a process; distinct across processes by a random node number."""

    def __init__(self, node: int | None = None) -> None:
        self._node = (node if node is not None else random.SystemRandom().getrandbits(_NODE_BITS)) & (
            (1 << _NODE_BITS) - 1
        )
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


class NoFreeNode(RuntimeError):
    """Every one of the 1024 node numbers is leased by a live process."""


class LeasedIds:
    """Ids from a node number leased in PostgreSQL: renewed in the background, released by `close()`.

    `next()` refuses (UNAVAILABLE) once the lease may have lapsed, so a process cut off from the database past its
    lease never makes an id with a number another process may have leased since.
    """

    def __init__(self, pool: asyncpg.Pool, *, lease_seconds: float, fixed_node: int | None = None) -> None:
        self._pool = pool
        self._seconds = lease_seconds
        self._fixed = fixed_node
        self._holder = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        self._generator: IdGenerator | None = None
        self._node: int | None = None
        self._valid_until = 0.0  # time.monotonic(); never later than the database's own expiry
        self._keeper: asyncio.Task[None] | None = None

    @property
    def node(self) -> int | None:
        """The node number in use (None before `start()`)."""
        return self._node

    async def start(self) -> None:
        """Leases a node number (or takes the fixed one) and starts renewing it; NoFreeNode when none is free."""
        if self._fixed is not None:
            self._node, self._generator, self._valid_until = self._fixed, IdGenerator(self._fixed), float("inf")
            return
        await self._lease()
        self._keeper = asyncio.create_task(self._keep(), name="id-node-lease")

    def next(self) -> int:
        """A fresh id; UNAVAILABLE (retryable) while the lease is not known to be held."""
        if self._generator is None or time.monotonic() >= self._valid_until:
            raise errors.unavailable("this replica's task id node lease lapsed; retry", retry_after=0.2)
        return self._generator.next()

    async def close(self) -> None:
        """Stops renewing and releases the node number (best effort: an unreleased one frees itself at expiry)."""
        if self._keeper is not None:
            self._keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._keeper
            self._keeper = None
        node, self._generator, self._valid_until = self._node, None, 0.0
        if node is not None and self._fixed is None:
            try:
                await asyncio.wait_for(nodes.release(self._pool, node=node, holder=self._holder), 5)
            except Exception as exc:  # the lease lapses on its own
                log.warning("id node not released", extra={"node": node, "error": type(exc).__name__})

    async def _lease(self) -> None:
        began = time.monotonic()  # before the statement: the database's now() is later, so its expiry is too
        node = await nodes.lease(self._pool, holder=self._holder, seconds=self._seconds)
        if node is None:
            raise NoFreeNode("all 1024 task id node numbers are leased by live processes")
        self._node, self._generator, self._valid_until = node, IdGenerator(node), began + self._seconds
        log.info("id node leased", extra={"node": node, "lease_seconds": self._seconds})

    async def _keep(self) -> None:
        """Renews four times per lease; a number lost to another holder is replaced by a fresh lease. A failed renewal
        is logged and tried again next period (the database may be back); next() refuses once the lease lapses."""
        await loops.repeat(
            self._renew, every=self._seconds / 4, wait_first=True, log=log, failed="id node lease not renewed",
            extra=lambda: {"node": self._node},
        )

    async def _renew(self) -> None:
        assert self._node is not None
        began = time.monotonic()
        if await nodes.renew(self._pool, node=self._node, holder=self._holder, seconds=self._seconds):
            self._valid_until = began + self._seconds
        else:
            log.warning("id node lease lost; leasing another", extra={"node": self._node})
            self._generator, self._valid_until = None, 0.0
            await self._lease()


_default: IdGenerator | None = None
_default_pid = 0


def new_id() -> int:
    """A fresh task id from a random node number (tests, tools; services use LeasedIds); re-seeded after fork."""
    global _default, _default_pid
    if _default is None or _default_pid != os.getpid():
        _default, _default_pid = IdGenerator(), os.getpid()
    return _default.next()


MAX_ID = 2**63 - 1


def parse(text: str) -> int | None:
    """The task id a decimal string names (1 to 2**63 - 1, ASCII digits only), or None: the one rule for every
    reader."""
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
