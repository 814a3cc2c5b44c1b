"""API keys (stored hashed), tenants, webhook secrets, and the caller's identity on each RPC."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import re
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TypeVar

import asyncpg
import grpc

from taskgate import clienttokens, errors
from taskgate.listen import Handler, Listener
from taskgate.sealing import Sealer
from taskgate.store import admins, tenants
from taskgate.store.admins import Admin as Admin  # re-exported: TaskAdmin names its caller taskgate.auth.Admin
from taskgate.store.pool import Conn

# re-exported: services name the caller taskgate.auth.Principal
from taskgate.store.tenants import Principal as Principal
from taskgate.throttle import Throttle
from taskgate_api import reasons

T = TypeVar("T")

KEY_PREFIX = "tg_"
ADMIN_KEY_PREFIX = "tga_"
READ = "read"  # an admin credential's scopes: look (stats, listings, the audit log) ...
OPERATOR = "operator"  # ... or also act (requeue, purge, revoke, rotate, drain)
SCOPES = (READ, OPERATOR)
_TENANT_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # the tenant table's CHECK, so a bad name never reaches it


def valid_tenant_name(name: str) -> bool:
    """Whether `name` may name a tenant: 1-64 of A-Z a-z 0-9 _ - (so never U+0000 or a surrogate)."""
    return _TENANT_NAME.fullmatch(name) is not None


def hash_key(pepper: str, key: str) -> str:
    return hmac.new(pepper.encode(), key.encode(), hashlib.sha256).hexdigest()


def new_api_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def new_webhook_secret() -> str:
    """A Standard Webhooks secret: 'whsec_' + base64 of 32 random bytes."""
    return "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()


async def create_key(
    db: Conn,
    pepper: str,
    tenant_id: str,
    *,
    admin: bool = False,
    max_pending: int | None = None,
    submits_per_minute: int | None = None,
    max_priority: int | None = None,
    sealer: Sealer | None = None,
) -> tuple[str, str | None]:
    """Creates the tenant if new and a key for it; returns (key, webhook secret if the tenant was new). The secret is
    stored sealed (`sealer`, by default the one the pepper derives). `admin`: an operator admin credential named
    `tenant_id` instead (no tenant, no secret), as create_admin_key makes."""
    if admin:
        return (await create_admin_key(db, pepper, tenant_id, scope=OPERATOR))[0], None
    key = new_api_key()
    secret = new_webhook_secret()
    sealed = (sealer or Sealer.from_pepper(pepper)).seal(secret)
    tenant_was_new = await tenants.create_api_key(
        db,
        tenant_id=tenant_id,
        key_hash=hash_key(pepper, key),
        prefix=key[:10],
        max_pending=max_pending,
        submits_per_minute=submits_per_minute,
        first_secret=sealed,
        max_priority=max_priority,
    )
    return key, (secret if tenant_was_new else None)


DEFAULT_SECRET_OVERLAP = 24 * 3600.0  # seconds the previous webhook secrets keep signing after a rotation


@dataclass(frozen=True, slots=True)
class Rotated:
    """A webhook secret just added: the secret (shown once), when the ones before it stop signing, how many sign now."""

    secret: str
    previous_valid_until: datetime
    valid_secrets: int


async def create_admin_key(
    db: Conn, pepper: str, name: str, *, scope: str, expires_in_seconds: float | None = None
) -> tuple[str, datetime | None]:
    """An admin credential for `name` (an operator or a tool) with `scope`; returns (key, when it expires)."""
    key = ADMIN_KEY_PREFIX + secrets.token_urlsafe(32)
    expires = await admins.create(
        db,
        name=name,
        key_hash=hash_key(pepper, key),
        prefix=key[:10],
        scope=scope,
        expires_in_seconds=expires_in_seconds,
    )
    return key, expires


async def rotate_webhook_secret(pool: asyncpg.Pool, tenant_id: str, overlap_seconds: float, sealer: Sealer) -> Rotated:
    """Adds a new secret (stored sealed); the previous ones stay valid for `overlap_seconds`."""
    secret = new_webhook_secret()
    async with pool.acquire() as conn, conn.transaction():
        await tenants.rotate_webhook_secret(
            conn, tenant_id, secret=sealer.seal(secret), overlap_seconds=overlap_seconds
        )
        valid = await tenants.webhook_secrets(conn, tenant_id)
    return Rotated(secret, datetime.now(UTC) + timedelta(seconds=overlap_seconds), len(valid))


async def webhook_secrets(db: Conn, tenant_id: str, sealer: Sealer) -> list[str]:
    """The tenant's valid webhook secrets, opened, newest first (two during a rotation)."""
    return [sealer.open(stored) for stored in await tenants.webhook_secrets(db, tenant_id)]


REVOKED_CHANNEL = "taskgate_key_revoked"  # NOTIFY payload: the revoked key's hash (functions/key_revocation.sql)


class Session:
    """A stream's caller: its principal, and what ends its stream when its key is revoked or its client token expires.

    Nothing of it runs per item or per idle stream: `guard` notes the task that reads the stream, and a revocation (the
    Authenticator's registry of open streams by key) or the token's one expiry timer cancels that task while it waits
    for the stream's next item; the stream then ends with UNAUTHENTICATED saying why. (It raced every item against the
    revocation instead: a task per item and one per open stream, an eighth of an idle notifier's CPU.)
    """

    __slots__ = ("_cancelled", "_reading", "_task", "caller", "digest", "grant", "principal", "why")

    def __init__(self, principal: Principal, digest: str, grant: clienttokens.Grant | None = None) -> None:
        self.principal = principal
        self.digest = digest
        self.grant = grant  # a client token's: the stream ends when it expires
        self.caller = Caller(principal, grant)
        self.why: str | None = None  # why the stream ends (set once): the key was revoked, the token expired
        self._task: asyncio.Task[object] | None = None  # the task reading the guarded stream
        self._reading = False  # whether that task waits for the stream's next item (so a cancel lands inside it)
        self._cancelled = False  # whether `revoke` cancelled that task

    @property
    def revoked(self) -> bool:
        return self.why is not None

    def revoke(self, why: str = "the API key was revoked") -> None:
        """Ends the guarded stream with UNAUTHENTICATED saying `why`: at once when it waits for its next item, else as
        soon as the item being sent is out."""
        if self.why is not None:
            return
        self.why = why
        if self._reading and self._task is not None:
            self._cancelled = True
            self._task.cancel()

    async def guard(self, stream: AsyncIterator[T]) -> AsyncIterator[T]:
        """`stream`'s items until it ends, or until the key is revoked (or the client token expires): then
        UNAUTHENTICATED saying so."""
        task = asyncio.current_task()
        assert task is not None
        expiry = None
        if self.grant is not None:  # a client token's stream lasts as long as the token: one timer per stream
            left = self.grant.expires_at.timestamp() - time.time()
            expiry = asyncio.get_running_loop().call_later(max(left, 0.0), self.revoke, "the client token expired")
        self._task = task
        try:
            while self.why is None:
                self._reading = True
                try:
                    item = await anext(stream)
                except StopAsyncIteration:
                    return
                except asyncio.CancelledError:
                    # ours (the revocation's) unless someone else cancelled the task too (the call ended)
                    if not self._cancelled or task.uncancel() > 0:
                        raise
                    self._cancelled = False
                    break
                finally:
                    self._reading = False
                if self.why is None:
                    yield item
                del item  # not held while the next one is awaited (a stream's last message: ~1.6 KiB of upb)
            if self._cancelled:  # the stream swallowed the cancel: the task is not being cancelled by anyone else
                self._cancelled = False
                task.uncancel()
            raise errors.unauthenticated(self.why or "the API key was revoked")
        finally:
            self._task = None
            if expiry is not None:
                expiry.cancel()


class Authenticator:
    """Resolves `authorization: Bearer <key>` to a Principal, caching hits for a few seconds — and misses too, so a
    caller repeating an unknown key does not reach the database on every call (a key is random: none is created
    that a caller tried before).

    A revocation reaches it as a NOTIFY (`listener()`): the key's cached answer goes and its open streams end, within
    the notification's delivery; after the listen connection was lost, every cached answer goes and every open
    stream's key is looked up again.
    """

    CACHE_ENTRIES = 10_000  # per kind; a full cache is emptied (bounded memory whatever callers send)

    def __init__(
        self,
        pool: Conn,
        pepper: str,
        cache_seconds: float = 5.0,
        *,
        throttle: Throttle | None = None,
        service: str = "",
    ) -> None:
        self._pool = pool
        self._throttle = throttle  # every call of a known key takes a token from its tenant's bucket
        self._service = service
        self._pepper = pepper
        self._ttl = cache_seconds
        self._cache: dict[str, tuple[float, Principal]] = {}
        self._admins: dict[str, tuple[float, Admin]] = {}
        # digest -> until when, and why, it is refused here: "unknown", "tenant" (on TaskAdmin), "admin" (elsewhere)
        self._refused: dict[str, tuple[float, str]] = {}
        self._sessions: dict[str, set[Session]] = {}  # digest -> the open streams it authenticated
        self._generation = 0  # counts revocations: a lookup that began before one does not cache its answer
        self._rechecks: set[asyncio.Task[None]] = set()
        # tenant -> (until when, its valid client-token key ids and each one's end: None while current)
        self._client_keys: dict[str, tuple[float, dict[str, datetime | None]]] = {}

    def listener(self, dsn: str, also: dict[str, Handler] | None = None) -> Listener:
        """A listener of key revocations for this authenticator (run it as a task for the service's life), and of the
        channels in `also` on the same connection."""
        return Listener(dsn, {REVOKED_CHANNEL: self.revoked, **(also or {})})

    def revoked(self, digest: str | None) -> None:
        """A key was revoked (its hash), or (None) revocations may have been missed: forget what is cached, end the
        key's open streams (None: look every open stream's key up again)."""
        self._generation += 1
        if digest is not None:
            self._cache.pop(digest, None)
            self._admins.pop(digest, None)
            self._refused.pop(digest, None)
            for session in self._sessions.get(digest, ()):
                session.revoke()
            return
        self._cache.clear()
        self._admins.clear()
        if self._sessions:
            task = asyncio.get_running_loop().create_task(self._recheck(list(self._sessions)))
            self._rechecks.add(task)
            task.add_done_callback(self._rechecks.discard)

    async def _recheck(self, digests: list[str]) -> None:
        for digest in digests:
            if await tenants.lookup_api_key(self._pool, digest) is None:
                self.revoked(digest)

    async def open_stream(self, context: grpc.aio.ServicerContext, scope: str | None = None) -> Session:
        """The caller of a stream, registered so that a revocation ends it (`Session.guard`); `scope`: a client token
        with it is accepted too (its stream ends when the token expires). Each open_stream is paired with a
        close_stream once the stream ends."""
        if scope is not None and clienttokens.looks_like_token(_bearer(context)):
            found = await self.caller(context, scope)
            return Session(found.principal, "", found.grant)
        began = self._generation
        principal, digest = await self._resolve(context)
        session = Session(principal, digest)
        self._sessions.setdefault(digest, set()).add(session)
        if self._generation != began:  # a revocation arrived while the key was looked up
            try:
                await self._recheck([digest])
            except BaseException:
                self.close_stream(session)
                raise
        return session

    def close_stream(self, session: Session) -> None:
        """The stream of `session` ended: a revocation no longer looks for it."""
        left = self._sessions.get(session.digest)
        if left is not None:
            left.discard(session)
            if not left:
                del self._sessions[session.digest]

    @contextlib.asynccontextmanager
    async def stream(self, context: grpc.aio.ServicerContext) -> AsyncIterator[Session]:
        """The caller of a stream, for as long as it is open: `Session.guard` ends it when the key is revoked."""
        session = await self.open_stream(context)
        try:
            yield session
        finally:
            self.close_stream(session)

    async def principal(self, context: grpc.aio.ServicerContext) -> Principal:
        """The tenant calling (UNAUTHENTICATED without a live tenant key; PERMISSION_DENIED for an admin key or a
        client token)."""
        found, _ = await self._resolve(context)
        return found

    async def caller(self, context: grpc.aio.ServicerContext, scope: str) -> Caller:
        """The caller of a call a client token may make (GetTask, a result, WatchTask/WatchTasks, CancelTask): the
        tenant by its API key, or a client token's grant, which needs `scope` (PERMISSION_DENIED without it)."""
        bearer = _bearer(context)
        if clienttokens.looks_like_token(bearer):
            grant = await self._client_grant(bearer)
            if not grant.allows(scope):
                raise errors.permission_denied(
                    f"this client token lacks the {scope!r} scope", reason=reasons.CLIENT_TOKEN_SCOPE, scope=scope
                )
            if self._throttle is not None:
                await self._throttle.call(grant.tenant_id, self._service)
            return Caller(Principal(grant.tenant_id, None, None), grant)
        found, _ = await self._resolve(context)
        return Caller(found)

    async def _client_grant(self, token: str) -> clienttokens.Grant:
        """A token's grant once its signature (no database) and its key id (the tenant's valid ids, read once per
        cache period) check out; UNAUTHENTICATED otherwise."""
        try:
            grant = clienttokens.verify(token, self._pepper)
        except clienttokens.BadToken as exc:
            raise errors.unauthenticated(f"the client token is not valid ({exc})") from None
        now = time.monotonic()
        hit = self._client_keys.get(grant.tenant_id)
        if hit is None or hit[0] <= now:
            keys = {k.kid: k.valid_until for k in await tenants.client_token_keys(self._pool, grant.tenant_id)}
            if len(self._client_keys) > self.CACHE_ENTRIES:
                self._client_keys.clear()
            hit = (now + self._ttl, keys)
            self._client_keys[grant.tenant_id] = hit
        if grant.kid not in hit[1]:
            raise errors.unauthenticated("the client token was signed with a key that is no longer valid")
        until = hit[1][grant.kid]
        if until is not None and until <= datetime.now(UTC):
            raise errors.unauthenticated("the client token was signed with a key that is no longer valid")
        return grant

    def _digest(self, context: grpc.aio.ServicerContext) -> str:
        key = _bearer(context)
        if clienttokens.looks_like_token(key):
            raise errors.permission_denied(
                "a client token is not accepted here: this call needs the tenant's API key",
                reason=reasons.CLIENT_TOKEN_NOT_ACCEPTED,
            )
        return hash_key(self._pepper, key)

    async def admin(self, context: grpc.aio.ServicerContext, *, scope: str) -> Admin:
        """The admin calling TaskAdmin with a credential of `scope` (READ: any admin key; OPERATOR: an operator's):
        UNAUTHENTICATED for an unknown, revoked or expired key, PERMISSION_DENIED for a tenant key or a read-only
        one."""
        digest = self._digest(context)
        now = time.monotonic()
        hit = self._admins.get(digest)
        if hit is not None and hit[0] > now:
            found = hit[1]
        else:
            self._refuse_if_known(digest, now)
            began = self._generation
            looked_up = await admins.lookup(self._pool, digest)
            if looked_up is None:
                why = "tenant" if await tenants.lookup_api_key(self._pool, digest) is not None else "unknown"
                self._remember_refused(digest, now, why)
                raise _refusal(why)
            found = looked_up
            if len(self._admins) > self.CACHE_ENTRIES:
                self._admins.clear()
            if self._generation == began:
                self._admins[digest] = (now + self._ttl, found)
        if found.expired or (found.expires_at is not None and found.expires_at <= datetime.now(UTC)):
            raise errors.unauthenticated(f"the admin key {found.prefix} expired")
        if scope == OPERATOR and found.scope != OPERATOR:
            raise errors.permission_denied(
                f"this call needs an operator admin key; {found.prefix} is {found.scope}-only",
                reason=reasons.ADMIN_SCOPE,
            )
        if self._throttle is not None:
            await self._throttle.call(found.name, self._service)
        return found

    def _refuse_if_known(self, digest: str, now: float) -> None:
        until, why = self._refused.get(digest, (0.0, ""))
        if until > now:
            raise _refusal(why)

    def _remember_refused(self, digest: str, now: float, why: str) -> None:
        if len(self._refused) > self.CACHE_ENTRIES:
            self._refused.clear()
        self._refused[digest] = (now + self._ttl, why)

    async def _resolve(self, context: grpc.aio.ServicerContext) -> tuple[Principal, str]:
        digest = self._digest(context)
        now = time.monotonic()
        hit = self._cache.get(digest)
        if hit is not None and hit[0] > now:
            found = hit[1]
        else:
            self._refuse_if_known(digest, now)
            began = self._generation
            looked_up = await tenants.lookup_api_key(self._pool, digest)
            if looked_up is None:
                why = "admin" if await admins.lookup(self._pool, digest) is not None else "unknown"
                self._remember_refused(digest, now, why)
                raise _refusal(why)
            found = looked_up
            if len(self._cache) > self.CACHE_ENTRIES:
                self._cache.clear()
            if self._generation == began:
                self._cache[digest] = (now + self._ttl, found)
        if self._throttle is not None:
            await self._throttle.call(found.tenant_id, self._service)
        return found, digest


@dataclass(frozen=True, slots=True)
class Caller:
    """Who makes a call a client token may make: the tenant, and the token's grant when it is one (None: the
    tenant's own API key, which sees every task of the tenant)."""

    principal: Principal
    grant: clienttokens.Grant | None = None

    @property
    def tenant_id(self) -> str:
        return self.principal.tenant_id

    def may_see(self, user_id: str, end_user: str, task_id: int) -> bool:
        """Whether a task is this caller's: its tenant's, and for a token its end user's (and listed, if it lists)."""
        if self.grant is None:
            return user_id == self.principal.tenant_id
        return self.grant.covers(user_id, end_user, task_id)


def _bearer(context: grpc.aio.ServicerContext) -> str:
    """The call's bearer credential (an API key or a client token); UNAUTHENTICATED without one."""
    key = None
    for name, value in context.invocation_metadata() or ():
        if name == "authorization" and isinstance(value, str) and value.startswith("Bearer "):
            key = value[len("Bearer ") :].strip()
    if not key:
        raise errors.unauthenticated()
    return key


def _refusal(why: str) -> errors.ApiError:
    """The error for a key refused by the service asking: unknown, a tenant's on TaskAdmin, an admin's elsewhere."""
    if why == "tenant":
        return errors.permission_denied(
            "this call needs an admin key; a tenant API key is not one", reason=reasons.NOT_AN_ADMIN_KEY
        )
    if why == "admin":
        return errors.permission_denied(
            "an admin key is not accepted here: use a tenant's API key", reason=reasons.ADMIN_KEY_NOT_ACCEPTED
        )
    return errors.unauthenticated()
