"""Applies the numbered SQL migrations once, under an advisory lock, so replicas may start together."""

from __future__ import annotations

import asyncio
import logging

import asyncpg

from taskgate import embedded, sql, telemetry
from taskgate.config import load_settings

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


async def migrate_database(database_url: str) -> list[int]:
    """Connects to `database_url` and applies the pending migrations; returns their versions."""
    conn = await asyncpg.connect(database_url, timeout=30)
    try:
        return await migrate(conn)
    finally:
        await conn.close()


def main() -> None:
    """`python -m taskgate.migrate`: brings the configured database up to date (the Kubernetes migrations Job)."""
    settings = load_settings()
    telemetry.configure_logging("migrate", settings.log_level)
    running = embedded.running_urls(settings.state_dir)
    database_url = settings.database_url or (running[0] if running else None)
    if database_url is None:
        raise SystemExit("taskgate: set TASKGATE_DATABASE_URL (or start `python -m taskgate.stack`)")
    try:
        applied = asyncio.run(migrate_database(database_url))
    except (TimeoutError, OSError, asyncpg.PostgresError) as exc:
        log.error("migrations failed", extra={"error": f"{type(exc).__name__}: {exc}"})
        raise SystemExit(1) from None
    log.info("schema up to date", extra={"applied": applied, "latest": max(v for v, _, _ in sql.migrations())})


if __name__ == "__main__":
    main()
