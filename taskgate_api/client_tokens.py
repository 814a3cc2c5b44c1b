"""What a client token says, shared by the gateway (which mints and verifies them: taskgate/clienttokens.py) and the
SDK (which mints them offline: taskgate_client.tokens): the claims, the scopes, the lifetimes and the secret's form.

A client token is a JWT signed HS256 with one tenant's client-token key; a library (PyJWT) signs and checks it.
Claims: `iss` "taskgate", `ten` the tenant, `sub` the end user ('' the tenant's own tasks), `scope` (space-separated:
read, watch, cancel), `tasks` (optional: the only task ids it covers), `iat`, `exp` (at most an hour after `iat`);
the header's `kid` names the key. The secret a tenant is given: `tgcs.<tenant>.<kid>.<key, base64url>`.
"""

from __future__ import annotations

import base64
from collections.abc import Collection
from dataclasses import dataclass

ISSUER = "taskgate"
SECRET_PREFIX = "tgcs"
READ, WATCH, CANCEL = "read", "watch", "cancel"
SCOPES = frozenset({READ, WATCH, CANCEL})
DEFAULT_SCOPES = (READ, WATCH)
DEFAULT_TTL_SECONDS = 900.0
MAX_TTL_SECONDS = 3600.0


@dataclass(frozen=True)
class Secret:
    """A tenant's client-token secret, parsed: whose, its key id and the key."""

    tenant_id: str
    kid: str
    key: bytes

    def __str__(self) -> str:
        return ".".join(
            [SECRET_PREFIX, self.tenant_id, self.kid, base64.urlsafe_b64encode(self.key).decode().rstrip("=")]
        )

    @classmethod
    def parse(cls, text: str) -> Secret:
        """The secret from its text form; ValueError when it is not one."""
        parts = text.strip().split(".")
        if len(parts) != 4 or parts[0] != SECRET_PREFIX or not all(parts[1:]):
            raise ValueError("not a client-token secret (tgcs.<tenant>.<key id>.<key>)")
        key = base64.urlsafe_b64decode(parts[3] + "=" * (-len(parts[3]) % 4))
        return cls(parts[1], parts[2], key)


def claims(
    tenant_id: str, end_user: str, *, scopes: Collection[str] = DEFAULT_SCOPES,
    task_ids: Collection[int | str] | None = None, ttl_seconds: float = DEFAULT_TTL_SECONDS, now: float,
) -> dict[str, object]:
    """A token's claims; ValueError for no or an unknown scope, or a lifetime outside (0, 1 h]."""
    if not scopes or set(scopes) - SCOPES:
        raise ValueError(f"scopes must be some of {', '.join(sorted(SCOPES))}")
    if not 0 < ttl_seconds <= MAX_TTL_SECONDS:
        raise ValueError(f"ttl must be above 0 and at most {MAX_TTL_SECONDS:g} seconds")
    issued = int(now)
    out: dict[str, object] = {
        "iss": ISSUER, "ten": tenant_id, "sub": end_user, "scope": " ".join(sorted(set(scopes))),
        "iat": issued, "exp": issued + int(ttl_seconds),
    }
    if task_ids is not None:
        out["tasks"] = sorted(str(t) for t in task_ids)
    return out
