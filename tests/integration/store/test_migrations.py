"""Migrations are checksummed and run once; the functions and triggers of sql/functions/ come back on every migrate."""

from __future__ import annotations

import logging
import re
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest

from taskgate import sql
from taskgate.migrate import MigrationEdited, migrate

# Every function and user trigger of the schema, with its full definition (and whether the trigger is enabled).
DEFINITIONS = """
SELECT p.proname AS name, pg_get_functiondef(p.oid) AS definition
FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace WHERE n.nspname = 'public'
UNION ALL
SELECT t.tgname, pg_get_triggerdef(t.oid) || ' enabled=' || t.tgenabled::text FROM pg_trigger t WHERE NOT t.tgisinternal
"""


@pytest.fixture
async def conn(database_url: str) -> AsyncIterator[asyncpg.Connection]:
    """A connection to this test's own copy of the migrated template."""
    c = await asyncpg.connect(database_url)
    try:
        yield c
    finally:
        await c.close()


@pytest.fixture
def sql_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of taskgate/sql/ that the loader reads instead, so a test may edit or add files."""
    copy = tmp_path / "taskgate" / "sql"
    shutil.copytree(sql.HERE, copy, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    monkeypatch.setattr(sql, "HERE", copy)
    return copy


async def definitions(conn: asyncpg.Connection) -> dict[str, str]:
    return {r["name"]: r["definition"] for r in await conn.fetch(DEFINITIONS)}


async def ledger(conn: asyncpg.Connection) -> dict[int, str | None]:
    return {r["version"]: r["checksum"] for r in await conn.fetch("SELECT version, checksum FROM schema_migration")}


async def test_migrating_twice_changes_nothing(conn: asyncpg.Connection) -> None:
    before = await definitions(conn)
    assert await migrate(conn) == []
    assert await migrate(conn) == []
    assert await definitions(conn) == before
    assert await ledger(conn) == {m.version: m.checksum for m in sql.migrations()}


async def test_an_edited_applied_migration_is_refused(conn: asyncpg.Connection, sql_copy: Path) -> None:
    edited = sql_copy / "migrations" / "0004_notifier_outbox.sql"
    edited.write_text(edited.read_text() + "ALTER TABLE worker ADD COLUMN region text;\n")
    pending = sql.migrations()[-1].version + 1
    (sql_copy / "migrations" / f"{pending:04d}_pending.sql").write_text("CREATE TABLE pending_probe (id integer);\n")
    with pytest.raises(MigrationEdited) as refused:
        await migrate(conn)
    message = str(refused.value)
    assert "taskgate/sql/migrations/0004_notifier_outbox.sql" in message
    assert f"new migration ({pending + 1:04d}_<what>.sql)" in message
    assert "0001_initial" not in message
    # refused before anything ran: the pending migration waits, the edit is not applied
    assert await conn.fetchval("SELECT to_regclass('pending_probe')") is None
    assert await conn.fetchval("SELECT count(*) FROM information_schema.columns WHERE column_name = 'region'") == 0


async def test_a_new_migration_is_applied_and_recorded(conn: asyncpg.Connection, sql_copy: Path) -> None:
    probe = sql.migrations()[-1].version + 1
    (sql_copy / "migrations" / f"{probe:04d}_probe.sql").write_text("CREATE TABLE probe (id integer);\n")
    assert await migrate(conn) == [probe]
    assert (await ledger(conn))[probe] == sql.migrations()[-1].checksum
    assert await conn.fetchval("SELECT to_regclass('probe')::text") == "probe"
    assert await migrate(conn) == []


async def test_migrations_applied_before_checksums_are_baselined_once(
    conn: asyncpg.Connection, caplog: pytest.LogCaptureFixture
) -> None:
    # the ledger as databases made before checksums have it
    await conn.execute("ALTER TABLE schema_migration DROP COLUMN checksum")
    with caplog.at_level(logging.INFO, logger="taskgate.migrate"):
        assert await migrate(conn) == []
    expected = {m.version: m.checksum for m in sql.migrations()}
    assert await ledger(conn) == expected
    baselined = [r.__dict__["version"] for r in caplog.records if r.getMessage() == "migration checksum baselined"]
    assert sorted(baselined) == sorted(expected)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="taskgate.migrate"):
        assert await migrate(conn) == []
    assert not [r for r in caplog.records if r.getMessage() == "migration checksum baselined"]


async def test_functions_and_triggers_are_reapplied_on_every_migrate(conn: asyncpg.Connection) -> None:
    before = await definitions(conn)
    assert {"task_record_event", "submit_tasks", "task_event_on_insert", "task_event_on_update"} <= before.keys()
    await conn.execute("DROP FUNCTION task_record_event() CASCADE")  # takes both triggers with it
    assert await definitions(conn) != before
    assert await migrate(conn) == []
    assert await definitions(conn) == before

    changed = (sql.HERE / "functions" / "submit_fast_path.sql").read_text().replace("'no_tenant'", "'nobody'")
    await conn.execute(changed)
    await conn.execute("ALTER TABLE task DISABLE TRIGGER task_event_on_update")
    assert await definitions(conn) != before
    assert await migrate(conn) == []
    assert await definitions(conn) == before


async def test_an_older_release_leaves_a_newer_schemas_functions_alone(
    conn: asyncpg.Connection, caplog: pytest.LogCaptureFixture
) -> None:
    newer = sql.migrations()[-1].version + 1
    await conn.execute(
        "INSERT INTO schema_migration (version, name, checksum) VALUES ($1, 'from_the_future', 'x')", newer
    )
    changed = (sql.HERE / "functions" / "submit_fast_path.sql").read_text().replace("'no_tenant'", "'nobody'")
    await conn.execute(changed)
    after_newer = await definitions(conn)
    with caplog.at_level(logging.WARNING, logger="taskgate.migrate"):
        assert await migrate(conn) == []
    assert await definitions(conn) == after_newer
    assert any(r.getMessage() == "database is newer than this code: functions left as they are" for r in caplog.records)


def test_function_files_only_create_or_replace_and_migrations_do_not_use_them() -> None:
    defined: set[str] = set()
    for path in sql.functions():
        text = path.read_text()
        assert not re.findall(r"^CREATE\b(?! OR REPLACE)", text, re.MULTILINE), f"{path.name}: use CREATE OR REPLACE"
        defined |= set(re.findall(r"^CREATE OR REPLACE FUNCTION (\w+)", text, re.MULTILINE))
    assert {"task_record_event", "submit_tasks"} <= defined
    # functions/ runs after the migrations: a migration may drop one of its functions, never create or call it
    for migration in sql.migrations():
        code = re.sub(r"--[^\n]*", "", migration.text)
        code = re.sub(r"DROP FUNCTION (IF EXISTS )?\w+", "", code)
        used = {name for name in defined if re.search(rf"\b{name}\b", code)}
        assert not used, f"{migration.path.name} uses {used}: a function a migration needs belongs in a migration"


async def test_admin_keys_of_the_flagged_kind_become_operator_credentials(conn: asyncpg.Connection) -> None:
    """Migration 0029 as an installation upgrading meets it: a tenant key flagged admin (the former kind) becomes an
    operator credential named after its tenant, with the same hash (the key keeps working on TaskAdmin), and is no
    tenant key any more (TaskGateway refuses it)."""
    await conn.execute("DROP TABLE admin_credential, admin_audit")
    await conn.execute("DELETE FROM schema_migration WHERE version = 29")
    await conn.execute("INSERT INTO tenant (id) VALUES ('ops'), ('acme')")
    await conn.execute(
        "INSERT INTO api_key (tenant_id, key_hash, prefix, is_admin) VALUES ('ops', 'h-admin', 'tg_admin1', true), "
        "('acme', 'h-tenant', 'tg_acme01', false)"
    )
    assert await migrate(conn) == [29]
    assert [
        tuple(r) for r in await conn.fetch("SELECT name, key_hash, prefix, scope, expires_at FROM admin_credential")
    ] == [("ops", "h-admin", "tg_admin1", "operator", None)]
    assert [r["key_hash"] for r in await conn.fetch("SELECT key_hash FROM api_key")] == ["h-tenant"]
