"""Tenants, their API keys (stored as hashes) and their webhook secrets."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from taskgate import sql
from taskgate.store.pool import Conn


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling: a tenant, and its limits."""

    tenant_id: str
    max_pending: int | None
    submits_per_minute: int | None
    max_priority: int = 5  # NORMAL: HIGH is an entitlement


@dataclass(frozen=True, slots=True)
class Tenant:
    """A tenant's limits (None: the global setting; for a budget, none)."""

    id: str
    max_pending: int | None
    submits_per_minute: int | None
    max_priority: int
    share_weight: float = 1.0  # its share against other tenants of one priority (fair share: 2 gets twice 1's turns)
    gpu_seconds_per_day: float | None = None
    gpu_seconds_per_month: float | None = None
    max_pending_per_end_user: int | None = None  # each end user's own limits inside the tenant's (None: the setting)
    submits_per_minute_per_end_user: int | None = None
    tokens_per_day: int | None = None  # chat tokens per UTC day and month (None: no budget)
    tokens_per_month: int | None = None


@dataclass(frozen=True, slots=True)
class ApiKey:
    """A tenant key or an admin credential as listed: never the key itself, which is not stored."""

    id: int
    tenant_id: str  # an admin credential's name
    prefix: str
    is_admin: bool
    created_at: datetime
    revoked_at: datetime | None
    scope: str | None = None  # an admin credential's: "read" or "operator"
    expires_at: datetime | None = None


@dataclass(frozen=True, slots=True)
class RevokedKey:
    """A key just revoked."""

    id: int
    tenant_id: str


async def create_api_key(
    db: Conn,
    *,
    tenant_id: str,
    key_hash: str,
    prefix: str,
    max_pending: int | None,
    submits_per_minute: int | None,
    first_secret: str,
    max_priority: int | None = None,
) -> bool:
    """Creates the tenant if new (with `first_secret`; given limits update an existing one) and a key for it.

    True when the tenant was new, so `first_secret` was stored.
    """
    row = await db.fetchrow(
        *sql.bind(
            "create_api_key",
            tenant_id=tenant_id,
            key_hash=key_hash,
            prefix=prefix,
            max_pending=max_pending,
            submits_per_minute=submits_per_minute,
            first_secret=first_secret,
            max_priority=max_priority,
        )
    )
    assert row is not None
    return bool(row["secret_created"])


async def lookup_api_key(db: Conn, key_hash: str) -> Principal | None:
    """The tenant and limits of a live key, or None for an unknown or revoked one."""
    row = await db.fetchrow(sql.query("lookup_api_key"), key_hash)
    if row is None:
        return None
    return Principal(row["tenant_id"], row["max_pending"], row["submits_per_minute"], row["max_priority"])


async def revoke_api_keys(db: Conn, prefix: str) -> list[RevokedKey]:
    """Revokes the live keys with a prefix (as listed); the ones it revoked."""
    rows = await db.fetch(sql.query("revoke_api_key"), prefix)
    return [RevokedKey(r["id"], r["tenant_id"]) for r in rows]


async def list_api_keys(db: Conn, tenant_id: str | None = None) -> list[ApiKey]:
    """Every key (of `tenant_id` when given), newest first."""
    rows = await db.fetch(sql.query("list_api_keys"), tenant_id)
    return [
        ApiKey(
            r["id"],
            r["tenant_id"],
            r["prefix"],
            r["is_admin"],
            r["created_at"],
            r["revoked_at"],
            r["scope"],
            r["expires_at"],
        )
        for r in rows
    ]


async def rotate_webhook_secret(db: Conn, tenant_id: str, *, secret: str, overlap_seconds: float) -> None:
    """Adds `secret`; the tenant's current ones stay valid for `overlap_seconds`."""
    await db.execute(sql.query("rotate_webhook_secret"), tenant_id, secret, overlap_seconds)


async def stored_webhook_secrets(db: Conn) -> list[tuple[int, str]]:
    """Every stored webhook secret as (id, stored value), retired ones too."""
    return [(r["id"], r["secret"]) for r in await db.fetch(sql.query("stored_webhook_secrets"))]


async def replace_webhook_secret(db: Conn, secret_id: int, *, stored: str, new: str) -> bool:
    """Stores `new` in place of `stored`; False when the row no longer holds `stored`."""
    return bool(await db.execute(sql.query("replace_webhook_secret"), secret_id, stored, new) == "UPDATE 1")


async def webhook_secrets(db: Conn, tenant_id: str) -> list[str]:
    """The tenant's valid secrets, newest first (two during a rotation)."""
    rows = await db.fetch(sql.query("webhook_secrets"), tenant_id)
    return [r["secret"] for r in rows]


async def update_tenant(
    db: Conn,
    tenant_id: str,
    *,
    max_pending: int | None,
    submits_per_minute: int | None,
    max_priority: int | None,
    share_weight: float | None = None,
    gpu_seconds_per_day: float | None = None,
    gpu_seconds_per_month: float | None = None,
    max_pending_per_end_user: int | None = None,
    submits_per_minute_per_end_user: int | None = None,
    tokens_per_day: int | None = None,
    tokens_per_month: int | None = None,
) -> Tenant | None:
    """Changes the limits given (None leaves one as it is; a budget of 0 removes it); the tenant after, or None when
    there is no such tenant."""
    row = await db.fetchrow(
        *sql.bind(
            "update_tenant",
            tenant_id=tenant_id,
            max_pending=max_pending,
            submits_per_minute=submits_per_minute,
            max_priority=max_priority,
            share_weight=share_weight,
            gpu_seconds_per_day=gpu_seconds_per_day,
            gpu_seconds_per_month=gpu_seconds_per_month,
            max_pending_per_end_user=max_pending_per_end_user,
            submits_per_minute_per_end_user=submits_per_minute_per_end_user,
            tokens_per_day=tokens_per_day,
            tokens_per_month=tokens_per_month,
        )
    )
    if row is None:
        return None
    return Tenant(
        row["id"], row["max_pending"], row["submits_per_minute"], row["max_priority"], row["share_weight"],
        row["gpu_seconds_per_day"], row["gpu_seconds_per_month"], row["max_pending_per_end_user"],
        row["submits_per_minute_per_end_user"], row["tokens_per_day"], row["tokens_per_month"],
    )


async def tenant_exists(db: Conn, tenant_id: str) -> bool:
    """Whether the tenant exists."""
    return bool(await db.fetchval(sql.query("tenant_exists"), tenant_id))


@dataclass(frozen=True, slots=True)
class ClientTokenKey:
    """One of a tenant's valid client-token key ids, and until when (None: current)."""

    kid: str
    valid_until: datetime | None


async def client_token_keys(db: Conn, tenant_id: str) -> list[ClientTokenKey]:
    """The tenant's client-token key ids that are still valid, newest first."""
    rows = await db.fetch(sql.query("client_token_keys"), tenant_id)
    return [ClientTokenKey(r["kid"], r["valid_until"]) for r in rows]


async def current_client_token_key(db: Conn, tenant_id: str, new_kid: str) -> str:
    """The tenant's current client-token key id, `new_kid` made current when it has none."""
    return str(await db.fetchval(sql.query("client_token_key_current"), tenant_id, new_kid))


async def rotate_client_token_key(
    db: Conn, tenant_id: str, new_kid: str, grace_seconds: float
) -> tuple[str, datetime] | None:
    """`new_kid` made the tenant's current key id, the older ones valid for `grace_seconds` more; (id, their end),
    or None when there is no such tenant."""
    row = await db.fetchrow(sql.query("client_token_key_rotate"), tenant_id, new_kid, grace_seconds)
    return None if row is None else (str(row["kid"]), row["previous_valid_until"])
