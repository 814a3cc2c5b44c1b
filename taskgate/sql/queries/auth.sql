-- name: create_api_key
-- Creates the tenant (and its first webhook secret) if new, then a key. $1 tenant, $2 key hash, $3 prefix,
-- $4 admin, $5 max pending, $6 submits per minute, $7 webhook secret for a new tenant, $8 max priority.
WITH t AS (
    INSERT INTO tenant (id, max_pending, submits_per_minute, max_priority) VALUES ($1, $5, $6, COALESCE($8, 5))
    ON CONFLICT (id) DO UPDATE SET max_pending = COALESCE($5, tenant.max_pending),
                                   submits_per_minute = COALESCE($6, tenant.submits_per_minute),
                                   max_priority = COALESCE($8, tenant.max_priority)
    RETURNING id, (xmax = 0) AS inserted
), s AS (
    INSERT INTO webhook_secret (tenant_id, secret) SELECT id, $7 FROM t WHERE inserted
    RETURNING id
), k AS (
    INSERT INTO api_key (tenant_id, key_hash, prefix, is_admin) SELECT id, $2, $3, $4 FROM t
    RETURNING id
)
SELECT (SELECT id FROM k) AS key_id, EXISTS (SELECT 1 FROM s) AS secret_created;

-- name: lookup_api_key
-- The tenant and limits of a live key. $1 key hash.
SELECT k.tenant_id, k.is_admin, t.max_pending, t.submits_per_minute, t.max_priority
FROM api_key k JOIN tenant t ON t.id = k.tenant_id
WHERE k.key_hash = $1 AND k.revoked_at IS NULL;

-- name: revoke_api_key
-- Revokes keys by prefix (as listed). $1 prefix.
UPDATE api_key SET revoked_at = now() WHERE prefix = $1 AND revoked_at IS NULL RETURNING id, tenant_id;

-- name: list_api_keys
-- Every key (of one tenant unless $1 is NULL), newest first, without secrets. $1 tenant.
SELECT k.id, k.tenant_id, k.prefix, k.is_admin, k.created_at, k.revoked_at
FROM api_key k WHERE $1::text IS NULL OR k.tenant_id = $1 ORDER BY k.created_at DESC, k.id DESC;

-- name: rotate_webhook_secret
-- Adds a secret and retires the current ones after an overlap. $1 tenant, $2 secret, $3 overlap seconds.
WITH retired AS (
    UPDATE webhook_secret SET retired_at = now() + make_interval(secs => $3)
    WHERE tenant_id = $1 AND (retired_at IS NULL OR retired_at > now() + make_interval(secs => $3))
)
INSERT INTO webhook_secret (tenant_id, secret) VALUES ($1, $2);

-- name: webhook_secrets
-- A tenant's valid webhook secrets, newest first. $1 tenant.
SELECT secret FROM webhook_secret
WHERE tenant_id = $1 AND (retired_at IS NULL OR retired_at > now())
ORDER BY created_at DESC, id DESC;

-- name: stored_webhook_secrets
-- Every stored webhook secret, retired ones too (taskgate-keys seal-secrets seals or re-seals them).
SELECT id, secret FROM webhook_secret ORDER BY id;

-- name: replace_webhook_secret
-- One stored secret replaced by its re-sealed value, unless it changed meanwhile. $1 id, $2 the value read, $3 new.
UPDATE webhook_secret SET secret = $3 WHERE id = $1 AND secret = $2;

-- name: update_tenant
-- Changes a tenant's limits (NULL leaves one as it is; a budget of 0 removes it); no row when there is no such
-- tenant. $1 tenant, $2 max pending, $3 submits per minute, $4 max priority, $5 share weight, $6 GPU-seconds per day,
-- $7 per month.
UPDATE tenant SET max_pending = COALESCE($2, max_pending), submits_per_minute = COALESCE($3, submits_per_minute),
                  max_priority = COALESCE($4, max_priority), share_weight = COALESCE($5, share_weight),
                  gpu_seconds_per_day = NULLIF(COALESCE($6, gpu_seconds_per_day), 0),
                  gpu_seconds_per_month = NULLIF(COALESCE($7, gpu_seconds_per_month), 0)
WHERE id = $1
RETURNING id, max_pending, submits_per_minute, max_priority, share_weight, gpu_seconds_per_day, gpu_seconds_per_month;

-- name: tenant_exists
-- Whether a tenant exists. $1 tenant.
SELECT EXISTS (SELECT 1 FROM tenant WHERE id = $1);
