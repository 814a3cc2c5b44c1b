"""Client tokens minted offline: a backend holding its tenant's client-token secret (`TaskGateway.GetClientTokenSecret`,
or `client.client_token_secret()`) gives a browser or an app a short-lived token for one end user's tasks, without a
call to the gateway. Needs PyJWT (`pip install 'taskgate-client[tokens]'`).

    token = mint_client_token(secret, "user-17", scopes=("read", "watch"), ttl_seconds=900)
    # the front end: GET /v1/tasks/{id} with `Authorization: Bearer <token>`, GET /v1/events?access_token=<token>
"""

from __future__ import annotations

import time
from collections.abc import Collection

from taskgate_api.client_tokens import DEFAULT_SCOPES, DEFAULT_TTL_SECONDS, Secret, claims


def mint_client_token(
    secret: str, end_user: str, *, scopes: Collection[str] = DEFAULT_SCOPES, task_ids: Collection[str] | None = None,
    ttl_seconds: float = DEFAULT_TTL_SECONDS,
) -> str:
    """A token for `end_user`'s tasks ('' the tenant's own), with `scopes` (read, watch, cancel), only `task_ids` when
    given, valid `ttl_seconds` (at most an hour). ValueError for a bad secret, scope or lifetime."""
    try:
        import jwt  # optional: only a backend that mints offline needs it
    except ImportError as exc:  # pragma: no cover - the extra is installed wherever this is tested
        raise RuntimeError("minting client tokens needs PyJWT: pip install 'taskgate-client[tokens]'") from exc
    parsed = Secret.parse(secret)
    body = claims(
        parsed.tenant_id, end_user, scopes=scopes, task_ids=task_ids, ttl_seconds=ttl_seconds, now=time.time()
    )
    return jwt.encode(body, parsed.key, algorithm="HS256", headers={"kid": parsed.kid})
