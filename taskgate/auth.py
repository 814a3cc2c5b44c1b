"""API keys (stored hashed), tenants, webhook secrets, and the caller's identity on each RPC."""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass

import asyncpg
import grpc

from taskgate import errors, sql

KEY_PREFIX = "tg_"


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling: a tenant, and whether the key may use the admin API."""

    tenant_id: str
    is_admin: bool
    max_pending: int | None
    submits_per_minute: int | None


def hash_key(pepper: str, key: str) -> str:
    return hmac.new(pepper.encode(), key.encode(), hashlib.sha256).hexdigest()


def new_api_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def new_webhook_secret() -> str:
    """A Standard Webhooks secret: 'whsec_' + base64 of 32 random bytes."""
    return "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()


async def create_key(
    db: asyncpg.Connection | asyncpg.Pool,
    pepper: str,
    tenant_id: str,
    *,
    admin: bool = False,
    max_pending: int | None = None,
    submits_per_minute: int | None = None,
) -> tuple[str, str | None]:
    """Creates the tenant if new and a key for it; returns (key, webhook secret if the tenant was new)."""
    key = new_api_key()
    secret = new_webhook_secret()
    row = await db.fetchrow(
        sql.query("create_api_key"),
        tenant_id,
        hash_key(pepper, key),
        key[:10],
        admin,
        max_pending,
        submits_per_minute,
        secret,
    )
    assert row is not None
    return key, (secret if row["secret_created"] else None)


async def rotate_webhook_secret(db: asyncpg.Connection | asyncpg.Pool, tenant_id: str, overlap_seconds: float) -> str:
    """Adds a new secret; the previous ones stay valid for `overlap_seconds`."""
    secret = new_webhook_secret()
    await db.execute(sql.query("rotate_webhook_secret"), tenant_id, secret, overlap_seconds)
    return secret


async def webhook_secrets(db: asyncpg.Connection | asyncpg.Pool, tenant_id: str) -> list[str]:
    """The tenant's valid secrets, newest first (two during a rotation)."""
    rows = await db.fetch(sql.query("webhook_secrets"), tenant_id)
    return [r["secret"] for r in rows]


class Authenticator:
    """Resolves `authorization: Bearer <key>` to a Principal, caching hits for a few seconds."""

    def __init__(self, pool: asyncpg.Pool, pepper: str, cache_seconds: float = 5.0) -> None:
        self._pool = pool
        self._pepper = pepper
        self._ttl = cache_seconds
        self._cache: dict[str, tuple[float, Principal]] = {}

    async def principal(self, context: grpc.aio.ServicerContext, *, admin: bool = False) -> Principal:
        key = None
        for name, value in context.invocation_metadata() or ():
            if name == "authorization" and isinstance(value, str) and value.startswith("Bearer "):
                key = value[len("Bearer ") :].strip()
        if not key:
            raise errors.unauthenticated()
        digest = hash_key(self._pepper, key)
        now = time.monotonic()
        hit = self._cache.get(digest)
        if hit is not None and hit[0] > now:
            found = hit[1]
        else:
            row = await self._pool.fetchrow(sql.query("lookup_api_key"), digest)
            if row is None:
                raise errors.unauthenticated()
            found = Principal(row["tenant_id"], row["is_admin"], row["max_pending"], row["submits_per_minute"])
            if len(self._cache) > 10_000:
                self._cache.clear()
            self._cache[digest] = (now + self._ttl, found)
        if admin and not found.is_admin:
            raise errors.permission_denied("this call needs an admin key")
        return found
