"""Applies the numbered SQL migrations once, under an advisory lock, so replicas may start together."""

from __future__ import annotations

import logging

import asyncpg

from taskgate import sql

log = logging.getLogger("taskgate.migrate")
_LOCK_KEY = 0x7461736B67617465  # "taskgate"


async def migrate(conn: asyncpg.Connection) -> list[int]:
    """Applies the migrations not yet applied; returns their versions."""
    applied_now: list[int] = []
    await conn.execute("SELECT pg_advisory_lock($1)", _LOCK_KEY)
    try:
        await conn.execute(
            "CREATE TABLE IF NOT EXISTS schema_migration ("
            " version integer PRIMARY KEY, name text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())"
        )
        done = {r["version"] for r in await conn.fetch("SELECT version FROM schema_migration")}
        for version, name, text in sql.migrations():
            if version in done:
                continue
            async with conn.transaction():
                await conn.execute(text)
                await conn.execute("INSERT INTO schema_migration (version, name) VALUES ($1, $2)", version, name)
            log.info("migration applied", extra={"version": version, "migration": name})
            applied_now.append(version)
    finally:
        await conn.execute("SELECT pg_advisory_unlock($1)", _LOCK_KEY)
    return applied_now
