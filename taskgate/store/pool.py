"""The connection pool every store operation runs on."""

from __future__ import annotations

import json
from typing import Any, TypeAlias

import asyncpg

from taskgate import sql

Conn: TypeAlias = "asyncpg.Connection[Any] | asyncpg.Pool[Any]"


def _jsonb_encode(value: Any) -> bytes:
    return b"\x01" + json.dumps(value).encode()  # jsonb's binary format: version 1, then the text


def _jsonb_decode(data: bytes) -> Any:
    return json.loads(data[1:])


async def _init_connection(conn: asyncpg.Connection) -> None:
    # jsonb in binary format (arrays of jsonb, as the submit columns are, travel in binary)
    await conn.set_type_codec(
        "jsonb", encoder=_jsonb_encode, decoder=_jsonb_decode, schema="pg_catalog", format="binary"
    )
    await conn.set_type_codec("json", encoder=json.dumps, decoder=json.loads, schema="pg_catalog")


async def _keep_session(conn: asyncpg.Connection) -> None:
    """A release that sends nothing: asyncpg's default reset query costs a round trip per checkout."""


async def create_pool(dsn: str, size: int = 10) -> asyncpg.Pool:
    """A pool whose connections decode json/jsonb to Python objects."""
    # no reset query on release: no caller leaves session state (settings via server_settings, LISTEN on its own conn)
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=size, init=_init_connection, reset=_keep_session)
    assert pool is not None
    return pool


async def ping(pool: asyncpg.Pool) -> None:
    """One round trip to PostgreSQL (a readiness probe's question); raises when it cannot be made."""
    await pool.fetchval(sql.query("health_ping"))
