"""Applies the numbered SQL migrations once (checksummed: an applied one must not change), then re-applies the
functions and triggers of taskgate/sql/functions/, all under an advisory lock, so replicas may start together.

Migrations hold schema only; a function that a DEFAULT, CHECK, index or generated column calls is schema too and
belongs in a migration (functions/ files run after the migrations). A function whose signature or result type
changes needs a migration that drops the old one: CREATE OR REPLACE cannot change them."""

from __future__ import annotations

import asyncio
import logging
import re

import asyncpg
from nats.errors import Error as NatsError

from taskgate import sql, telemetry
from taskgate.config import CommonSettings, load_settings
from taskgate.stackfile import local_stack_urls

log = logging.getLogger("taskgate.migrate")
_LOCK_KEY = 0x7461736B67617465  # "taskgate"
LOCK_TIMEOUT_MS = 10_000  # how long a migration or function re-apply waits for a table's lock
_COMMENT = re.compile(r"--[^\n]*")
# The ledger; `checksum` came later (NULL on rows applied before it, baselined by the next migrate).
_LEDGER = """
CREATE TABLE IF NOT EXISTS schema_migration (
    version integer PRIMARY KEY, name text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now(), checksum text);
ALTER TABLE schema_migration ADD COLUMN IF NOT EXISTS checksum text;
"""


class MigrationEdited(Exception):
    """An applied migration's file no longer holds the text that was applied."""


async def migrate(conn: asyncpg.Connection) -> list[int]:
    """Applies the migrations not yet applied, then re-applies every function file; returns the versions applied."""
    applied_now: list[int] = []
    await conn.execute("SELECT pg_advisory_lock($1)", _LOCK_KEY)  # replicas starting together wait here, unbounded
    try:
        # a schema change waiting behind a long transaction would stall every query queued behind its lock: give up
        await conn.execute(f"SET lock_timeout = '{LOCK_TIMEOUT_MS}ms'")
        await conn.execute(_LEDGER)
        recorded: dict[int, str | None] = {
            r["version"]: r["checksum"] for r in await conn.fetch("SELECT version, checksum FROM schema_migration")
        }
        files = sql.migrations()
        _refuse_edited(files, recorded)
        for migration in files:
            if migration.version not in recorded:
                async with conn.transaction():
                    if _COMMENT.sub("", migration.text).strip():  # asyncpg fails on a text with no statement
                        await conn.execute(migration.text)
                    await conn.execute(
                        "INSERT INTO schema_migration (version, name, checksum) VALUES ($1, $2, $3)",
                        migration.version, migration.name, migration.checksum,
                    )
                log.info("migration applied", extra={"version": migration.version, "migration": migration.name})
                applied_now.append(migration.version)
            elif recorded[migration.version] is None:  # applied before checksums were kept: trust the file once
                await conn.execute(
                    "UPDATE schema_migration SET checksum = $2 WHERE version = $1",
                    migration.version,
                    migration.checksum,
                )
                log.info(
                    "migration checksum baselined", extra={"version": migration.version, "migration": migration.name}
                )
        if max(recorded, default=0) > files[-1].version:
            # an older release must not put back the functions a newer schema replaced
            log.warning("database is newer than this code: functions left as they are",
                        extra={"database": max(recorded), "latest": files[-1].version})
        else:
            await _apply_functions(conn)
    finally:
        await conn.execute("SELECT pg_advisory_unlock($1)", _LOCK_KEY)
        await conn.execute("RESET lock_timeout")
    return applied_now


def _refuse_edited(files: list[sql.Migration], recorded: dict[int, str | None]) -> None:
    """Raises MigrationEdited naming every applied migration whose file's checksum differs from the recorded one."""
    edited = [m for m in files if recorded.get(m.version) not in (None, m.checksum)]
    if edited:
        names = ", ".join(str(m.path.relative_to(sql.HERE.parent.parent)) for m in edited)
        raise MigrationEdited(
            f"{names}: already applied to this database with a different text (its checksum changed). An applied "
            f"migration must not change: restore the file and write the change as a new migration "
            f"({files[-1].version + 1:04d}_<what>.sql)."
        )


async def _apply_functions(conn: asyncpg.Connection) -> None:
    """Runs every functions/*.sql (CREATE OR REPLACE) in one transaction."""
    paths = sql.functions()
    async with conn.transaction():
        for path in paths:
            await conn.execute(path.read_text(encoding="utf-8"))
    log.info("functions applied", extra={"files": [p.name for p in paths]})


async def migrate_database(database_url: str) -> list[int]:
    """Connects to `database_url` and applies the pending migrations; returns their versions."""
    conn = await asyncpg.connect(database_url, timeout=30)
    try:
        return await migrate(conn)
    finally:
        await conn.close()


async def declare_streams(settings: CommonSettings, nats_url: str) -> None:
    """Creates or updates every JetStream stream, consumer and bucket (the services' NATS users may not)."""
    from taskgate import bus  # late: the database-only path needs no NATS client

    connected = await bus.connect(nats_url, "migrate", tls_ca_file=settings.nats_tls_ca_file)
    try:
        await bus.declare(connected, settings)
    finally:
        await connected.close()


def main() -> None:
    """`python -m taskgate.migrate`: brings the configured database up to date and, when a NATS URL is configured,
    declares the streams (the Kubernetes migrations Job, run with the owner role and the NATS admin user)."""
    settings = load_settings()
    telemetry.configure_logging("migrate", settings.log_level)
    running = local_stack_urls(settings.state_dir)
    database_url = settings.database_url or (running[0] if running else None)
    nats_url = settings.nats_url or (running[1] if running else None)
    if database_url is None:
        raise SystemExit("taskgate: set TASKGATE_DATABASE_URL (or start `python -m taskgate_local.stack`)")
    try:
        applied = asyncio.run(migrate_database(database_url))
    except (TimeoutError, OSError, asyncpg.PostgresError, MigrationEdited) as exc:
        log.error("migrations failed", extra={"error": f"{type(exc).__name__}: {exc}"})
        raise SystemExit(1) from None
    log.info("schema up to date", extra={"applied": applied, "latest": sql.migrations()[-1].version})
    if nats_url is not None:
        try:
            asyncio.run(declare_streams(settings, nats_url))
        except (TimeoutError, OSError, NatsError) as exc:
            log.error("stream declaration failed", extra={"error": f"{type(exc).__name__}: {exc}"})
            raise SystemExit(1) from None
        log.info("streams declared")


if __name__ == "__main__":
    main()
