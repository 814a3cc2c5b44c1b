"""Short-lived client tokens: what a tenant's backend gives a browser or an app so that it can read, watch and
cancel one end user's tasks, and nothing else.

A token is a JWT (RFC 7519, HS256, PyJWT) naming the tenant (`ten`), the end user (`sub`), its scopes (`scope`: any of
read, watch, cancel), optionally the task ids it is limited to (`tasks`) and an expiry of at most an hour. It is
signed with the tenant's client-token secret, which is never stored: it is derived from the server's pepper, the
tenant and a key id (`kid`, in the token's header) by HMAC-SHA256, so a service checks a token's signature without
reading the database. A tenant's key ids live in `client_token_key` (migration 0038); rotating adds a new one and
gives the previous ones a grace period, after which their tokens are refused. Which ids are valid is read once per
tenant per cache period (the API keys' period), never per call.

The claims and the secret's form are `taskgate_api.client_tokens` (the SDK mints with the same).
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Collection
from dataclasses import dataclass
from datetime import UTC, datetime

import jwt

from taskgate_api.client_tokens import (
    CANCEL,
    DEFAULT_SCOPES,
    DEFAULT_TTL_SECONDS,
    ISSUER,
    MAX_TTL_SECONDS,
    READ,
    SCOPES,
    WATCH,
    Secret,
    claims,
)

__all__ = ["CANCEL", "DEFAULT_TTL_SECONDS", "MAX_TTL_SECONDS", "READ", "SCOPES", "WATCH", "BadToken", "Grant"]

LEEWAY_SECONDS = 5.0  # clocks of the minting backend and the gateway may differ a little


class BadToken(Exception):
    """A client token that is not accepted: malformed, tampered, expired, or signed with a retired key."""


@dataclass(frozen=True, slots=True)
class Grant:
    """What a verified client token allows: one end user's tasks of one tenant, for some scopes, until it expires."""

    tenant_id: str
    end_user: str
    scopes: frozenset[str]
    task_ids: frozenset[int] | None  # None: every task of the end user
    expires_at: datetime
    kid: str

    def allows(self, scope: str) -> bool:
        return scope in self.scopes

    def covers(self, user_id: str, end_user: str, task_id: int) -> bool:
        """Whether a task is one this token may see: its tenant's, its end user's, and listed when it lists tasks."""
        return (
            user_id == self.tenant_id and end_user == self.end_user
            and (self.task_ids is None or task_id in self.task_ids)
        )


def looks_like_token(bearer: str) -> bool:
    """Whether a bearer credential is a JWT (three base64url parts) rather than an API key."""
    return bearer.count(".") == 2 and bearer.startswith("eyJ")


def signing_key(pepper: str, tenant_id: str, kid: str) -> bytes:
    """The tenant's secret for key id `kid`: derived, never stored."""
    return hmac.new(pepper.encode(), f"client-token\x1f{tenant_id}\x1f{kid}".encode(), hashlib.sha256).digest()


def shared_secret(pepper: str, tenant_id: str, kid: str) -> str:
    """The secret as a tenant is given it: the tenant, the key id and the key, for the SDK's offline minting."""
    return str(Secret(tenant_id, kid, signing_key(pepper, tenant_id, kid)))


def mint(
    key: bytes, kid: str, tenant_id: str, end_user: str, *, scopes: Collection[str] = DEFAULT_SCOPES,
    task_ids: Collection[int | str] | None = None, ttl_seconds: float = DEFAULT_TTL_SECONDS, now: float | None = None,
) -> str:
    """A token signed with `key`; ValueError for an unknown scope or a lifetime outside (0, 1 h]."""
    body = claims(tenant_id, end_user, scopes=scopes, task_ids=task_ids, ttl_seconds=ttl_seconds,
                  now=now if now is not None else time.time())
    return jwt.encode(body, key, algorithm="HS256", headers={"kid": kid})


def verify(token: str, pepper: str) -> Grant:
    """The grant of a token whose signature, issuer, lifetime and claims check out (its key id's validity is the
    caller's to check); BadToken otherwise."""
    try:
        kid = jwt.get_unverified_header(token).get("kid")
        tenant = jwt.decode(token, options={"verify_signature": False}).get("ten")
        if not isinstance(kid, str) or not isinstance(tenant, str):
            raise BadToken("no key id or tenant")
        # the tenant claim picks the key: a token whose tenant was changed fails the signature check below
        claims = jwt.decode(
            token, signing_key(pepper, tenant, kid), algorithms=["HS256"], issuer=ISSUER,
            options={"require": ["exp", "iat", "sub", "ten", "scope"]}, leeway=LEEWAY_SECONDS,
        )
    except jwt.ExpiredSignatureError as exc:
        raise BadToken("expired") from exc
    except jwt.PyJWTError as exc:
        raise BadToken(str(exc)) from exc
    if claims["exp"] - claims["iat"] > MAX_TTL_SECONDS:
        raise BadToken("lives longer than an hour")
    scopes = frozenset(str(claims["scope"]).split())
    tasks = claims.get("tasks")
    try:
        task_ids = None if tasks is None else frozenset(int(t) for t in tasks)
    except (TypeError, ValueError) as exc:
        raise BadToken("task ids are not ids") from exc
    if not scopes or not scopes <= SCOPES or not isinstance(claims["sub"], str):
        raise BadToken("bad scope or end user")
    return Grant(tenant, claims["sub"], scopes, task_ids, datetime.fromtimestamp(claims["exp"], UTC), kid)
