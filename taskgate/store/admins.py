"""Admin credentials (their own kind: a named key with a scope and an expiry, for TaskAdmin only) and the audit log."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from taskgate import sql
from taskgate.store.pool import Conn


@dataclass(frozen=True, slots=True)
class Admin:
    """Who calls TaskAdmin: the credential's name, prefix and scope ("read" or "operator"), and when it expires."""

    credential_id: int
    name: str
    prefix: str
    scope: str
    expires_at: datetime | None
    expired: bool = False


@dataclass(frozen=True, slots=True)
class AuditEvent:
    """One admin action as it was asked for: who, what, on what, when, and whether it was a dry run."""

    id: int
    at: datetime
    admin: str
    prefix: str
    action: str
    target: str
    dry_run: bool
    detail: dict[str, Any]


async def create(
    db: Conn, *, name: str, key_hash: str, prefix: str, scope: str, expires_in_seconds: float | None
) -> datetime | None:
    """Stores an admin credential; when it expires (None: never)."""
    row = await db.fetchrow(
        *sql.bind(
            "create_admin_credential",
            name=name,
            key_hash=key_hash,
            prefix=prefix,
            scope=scope,
            expires_in_seconds=expires_in_seconds,
        )
    )
    assert row is not None
    expires: datetime | None = row["expires_at"]
    return expires


async def lookup(db: Conn, key_hash: str) -> Admin | None:
    """The unrevoked credential with this hash (expired ones too, marked), or None."""
    row = await db.fetchrow(sql.query("lookup_admin_credential"), key_hash)
    if row is None:
        return None
    return Admin(row["id"], row["name"], row["prefix"], row["scope"], row["expires_at"], row["expired"])


async def record(
    db: Conn,
    admin: Admin,
    action: str,
    *,
    target: str = "",
    dry_run: bool = False,
    detail: dict[str, Any] | None = None,
) -> None:
    """Appends one action to the audit log."""
    await db.execute(
        *sql.bind(
            "insert_admin_audit",
            admin=admin.name,
            prefix=admin.prefix,
            action=action,
            target=target,
            dry_run=dry_run,
            detail=detail or {},
        )
    )


async def audit(db: Conn, *, before_id: int | None, admin: str | None, limit: int) -> list[AuditEvent]:
    """Admin actions, newest first (of one admin when given), after the page ending at `before_id`."""
    rows = await db.fetch(sql.query("list_admin_audit"), before_id, admin, limit)
    return [
        AuditEvent(r["id"], r["at"], r["admin"], r["prefix"], r["action"], r["target"], r["dry_run"], r["detail"])
        for r in rows
    ]
