"""taskgate/sql/schema.sql is the schema the migrations make: a dump of a freshly migrated database equals it."""

from __future__ import annotations

import difflib

import asyncpg
import pytest

from taskgate_local.schemafile import SCHEMA_FILE, dump, recorded_major, server_major


async def test_the_schema_file_is_what_the_migrations_make(database_url: str) -> None:
    conn = await asyncpg.connect(database_url)
    try:
        major = await server_major(conn)
    finally:
        await conn.close()
    committed = SCHEMA_FILE.read_text()
    if recorded_major(committed) != major:
        pytest.skip(f"schema.sql was dumped from PostgreSQL {recorded_major(committed)}; this server is {major}")
    fresh = dump(database_url, major)
    drift = "".join(difflib.unified_diff(committed.splitlines(True), fresh.splitlines(True), "schema.sql", "migrated"))
    assert not drift, f"taskgate/sql/schema.sql drifted from the migrations: run `make schema`\n{drift[:4000]}"
