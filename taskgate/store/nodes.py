"""Leases of the ten-bit node numbers that keep task ids distinct between processes (taskgate/ids.py).

The SQL is the `id_node_*` blocks of sql/queries/ids.sql.
"""

from __future__ import annotations

from taskgate import sql
from taskgate.store.pool import Conn


async def lease(db: Conn, *, holder: str, seconds: float) -> int | None:
    """Leases the free node number that has rested longest for `seconds`; None when every number is held."""
    node = await db.fetchval(sql.query("id_node_lease"), holder, seconds)
    return int(node) if node is not None else None


async def renew(db: Conn, *, node: int, holder: str, seconds: float) -> bool:
    """Extends the lease by `seconds` from now; False when the number is no longer this holder's."""
    return await db.fetchval(sql.query("id_node_renew"), node, holder, seconds) is not None


async def release(db: Conn, *, node: int, holder: str) -> None:
    """Frees the number (no-op when another holder has it)."""
    await db.execute(sql.query("id_node_release"), node, holder)
