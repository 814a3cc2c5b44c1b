"""The TaskGateway calls for a tenant's secrets: its webhook secret (RotateWebhookSecret) and its client tokens
(CreateClientToken, GetClientTokenSecret), what a backend gives a browser or an app for one end user's tasks."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from datetime import UTC, datetime

from taskgate import auth, clienttokens, errors, ids
from taskgate.auth import DEFAULT_SECRET_OVERLAP
from taskgate.model import timestamp
from taskgate.store import tenants
from taskgate_api.v1 import gateway_pb2

from .core import Context, GatewayCore
from .validation import end_user_problem

log = logging.getLogger("taskgate.submit")


class SecretCalls(GatewayCore):
    """The TaskGateway calls for a tenant's webhook secret and client tokens (a mixin of Gateway)."""

    async def RotateWebhookSecret(
        self, request: gateway_pb2.TaskGatewayRotateWebhookSecretRequest, context: Context
    ) -> gateway_pb2.TaskGatewayRotateWebhookSecretResponse:
        """A new webhook secret for the caller's tenant; the current ones keep signing until the overlap ends."""
        who = await self._principal(context)
        overlap = (
            request.overlap.ToTimedelta().total_seconds() if request.HasField("overlap") else DEFAULT_SECRET_OVERLAP
        )
        most = self._settings.webhook_secret_max_overlap_seconds
        if not 0 <= overlap <= most:
            raise errors.invalid_argument([("overlap", f"must be between 0 and {most:g} seconds")])
        rotated = await asyncio.wait_for(
            auth.rotate_webhook_secret(self._pool, who.tenant_id, overlap, self._sealer), self._budget(context)
        )
        log.info("webhook secret rotated", extra={"tenant": who.tenant_id, "overlap_seconds": overlap, "by": "tenant"})
        return gateway_pb2.TaskGatewayRotateWebhookSecretResponse(
            webhook_secret=rotated.secret, previous_valid_until=timestamp(rotated.previous_valid_until),
            valid_secrets=rotated.valid_secrets,
        )

    # Client tokens: what a backend gives a browser or an app for one end user's tasks

    async def _client_token_kid(self, tenant: str, context: Context) -> str:
        return await asyncio.wait_for(
            tenants.current_client_token_key(self._pool, tenant, secrets.token_hex(8)), self._budget(context)
        )

    async def CreateClientToken(
        self, request: gateway_pb2.CreateClientTokenRequest, context: Context
    ) -> gateway_pb2.CreateClientTokenResponse:
        """A token for one end user's tasks, signed with the tenant's current client-token key (API key only)."""
        who = await self._principal(context)
        bad: list[tuple[str, str]] = []
        if (why := end_user_problem(request.end_user)) is not None:
            bad.append(("end_user", why))
        scopes = set(request.scopes) or {clienttokens.READ, clienttokens.WATCH}
        if not scopes <= clienttokens.SCOPES:
            bad.append(("scopes", f"each must be one of {', '.join(sorted(clienttokens.SCOPES))}"))
        ttl = request.ttl.ToTimedelta().total_seconds() if request.HasField("ttl") else clienttokens.DEFAULT_TTL_SECONDS
        if not 0 < ttl <= clienttokens.MAX_TTL_SECONDS:
            bad.append(("ttl", f"must be above 0 and at most {clienttokens.MAX_TTL_SECONDS:g} seconds"))
        task_ids: list[int] = []
        for value in request.task_ids:
            try:
                task_ids.append(ids.require(value))
            except errors.ApiError:
                bad.append(("task_ids", "each must be a task id"))
                break
        if bad:
            raise errors.invalid_argument(bad)
        kid = await self._client_token_kid(who.tenant_id, context)
        key = clienttokens.signing_key(self._settings.api_key_pepper, who.tenant_id, kid)
        now = time.time()
        token = clienttokens.mint(
            key,
            kid,
            who.tenant_id,
            request.end_user,
            scopes=scopes,
            task_ids=task_ids or None,
            ttl_seconds=ttl,
            now=now,
        )
        return gateway_pb2.CreateClientTokenResponse(
            token=token, expires_at=timestamp(datetime.fromtimestamp(int(now) + int(ttl), UTC))
        )

    async def GetClientTokenSecret(
        self, request: gateway_pb2.GetClientTokenSecretRequest, context: Context
    ) -> gateway_pb2.GetClientTokenSecretResponse:
        """The tenant's client-token secret (the SDK mints offline with it), a new one with `rotate`."""
        who = await self._principal(context)
        pepper = self._settings.api_key_pepper
        if not request.rotate:
            kid = await self._client_token_kid(who.tenant_id, context)
            return gateway_pb2.GetClientTokenSecretResponse(
                secret=clienttokens.shared_secret(pepper, who.tenant_id, kid), key_id=kid
            )
        overlap = request.overlap.ToTimedelta().total_seconds() if request.HasField("overlap") else 3600.0
        most = self._settings.client_token_max_overlap_seconds
        if not 0 <= overlap <= most:
            raise errors.invalid_argument([("overlap", f"must be between 0 and {most:g} seconds")])
        rotated = await asyncio.wait_for(
            tenants.rotate_client_token_key(self._pool, who.tenant_id, secrets.token_hex(8), overlap),
            self._budget(context),
        )
        if rotated is None:
            raise errors.unauthenticated("the key's tenant no longer exists")
        kid, previous_until = rotated
        log.info("client-token secret rotated", extra={"tenant": who.tenant_id, "overlap_seconds": overlap})
        return gateway_pb2.GetClientTokenSecretResponse(
            secret=clienttokens.shared_secret(pepper, who.tenant_id, kid), key_id=kid,
            previous_valid_until=timestamp(previous_until),
        )
