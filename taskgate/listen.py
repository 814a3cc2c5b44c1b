"""A dedicated PostgreSQL connection that LISTENs for wake-ups and reconnects when it is lost."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

import asyncpg

from taskgate import loops

log = logging.getLogger("taskgate.listen")

Handler = Callable[[str | None], None]  # called with a NOTIFY's payload, or None once (re)connected: some were missed


class Listener:
    """Calls a handler on each NOTIFY of its channel; after a reconnect calls them all (notifications were missed)."""

    def __init__(self, dsn: str, handlers: dict[str, Handler], retry_seconds: float = 1.0) -> None:
        self._dsn = dsn
        self._handlers = handlers
        self._retry = retry_seconds
        self._conn: asyncpg.Connection | None = None
        self.connected = asyncio.Event()

    def _on_notify(self, _conn: Any, _pid: int, channel: str, payload: str) -> None:
        handler = self._handlers.get(channel)
        if handler is not None:
            handler(payload)

    async def run(self) -> None:
        """Listens until cancelled, connecting again `retry_seconds` after a connection failed or was lost."""
        await loops.repeat(
            self._listen, every=self._retry, log=log, failed="listen connection failed",
            survives=(OSError, asyncpg.PostgresError, asyncpg.InterfaceError),
        )

    async def _listen(self) -> None:
        """One connection's life: connects, listens, and returns once the connection is lost."""
        conn = await asyncpg.connect(self._dsn)
        lost = asyncio.Event()
        self._conn = conn
        try:
            conn.add_termination_listener(lambda _c: lost.set())
            for channel in self._handlers:
                await conn.add_listener(channel, self._on_notify)
            self.connected.set()
            for handler in self._handlers.values():
                handler(None)
            await lost.wait()
            log.warning("listen connection lost")
        finally:
            self.connected.clear()
            self._conn = None
            with contextlib.suppress(Exception):
                conn.terminate()

    def terminate(self) -> None:
        """Drops the connection at once (crash tests)."""
        if self._conn is not None:
            self._conn.terminate()
