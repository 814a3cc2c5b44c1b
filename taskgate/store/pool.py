"""The connection pool every store operation runs on."""

from __future__ import annotations

import json
from typing import Any, TypeAlias

import asyncpg

Conn: TypeAlias = "asyncpg.Connection[Any] | asyncpg.Pool[Any]"


async def _init_connection(conn: asyncpg.Connection) -> None:
    for typ in ("jsonb", "json"):
        await conn.set_type_codec(typ, encoder=json.dumps, decoder=json.loads, schema="pg_catalog")


async def _keep_session(conn: asyncpg.Connection) -> None:
    """A release that sends nothing: asyncpg's default reset query costs a round trip per checkout."""


async def create_pool(dsn: str, size: int = 10) -> asyncpg.Pool:
    """A pool whose connections decode json/jsonb to Python objects."""
    # no reset query on release: no caller leaves session state (settings via server_settings, LISTEN on its own conn)
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=size, init=_init_connection, reset=_keep_session)
    assert pool is not None
    return pool
