"""A dedicated PostgreSQL connection that LISTENs for wake-ups and reconnects when it is lost."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

import asyncpg

from taskgate.waiting import cancelling

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
        """Listens until cancelled."""
        while True:
            lost = asyncio.Event()
            try:
                conn = await asyncpg.connect(self._dsn)
            except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
                log.warning("listen connection failed", extra={"error": type(exc).__name__})
                await asyncio.sleep(self._retry)
                continue
            self._conn = conn
            try:
                conn.add_termination_listener(lambda _c, lost=lost: lost.set())
                for channel in self._handlers:
                    await conn.add_listener(channel, self._on_notify)
                self.connected.set()
                for handler in self._handlers.values():
                    handler(None)
                await lost.wait()
                log.warning("listen connection lost")
            except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
                if cancelling():
                    raise asyncio.CancelledError from exc
                log.warning("listen connection failed", extra={"error": type(exc).__name__})
            finally:
                self.connected.clear()
                self._conn = None
                with contextlib.suppress(Exception):
                    conn.terminate()
            await asyncio.sleep(self._retry)

    def terminate(self) -> None:
        """Drops the connection at once (crash tests)."""
        if self._conn is not None:
            self._conn.terminate()
