-- name: create_api_key
-- Creates the tenant (and its first webhook secret) if new, then a key (a tenant's: admin credentials are
-- create_admin_credential's). @first_secret: the webhook secret of a new tenant.
WITH t AS (
    INSERT INTO tenant (id, max_pending, submits_per_minute, max_priority) VALUES (@tenant_id, @max_pending, @submits_per_minute, COALESCE(@max_priority, 5))
    ON CONFLICT (id) DO UPDATE SET max_pending = COALESCE(@max_pending, tenant.max_pending),
                                   submits_per_minute = COALESCE(@submits_per_minute, tenant.submits_per_minute),
                                   max_priority = COALESCE(@max_priority, tenant.max_priority)
    RETURNING id, (xmax = 0) AS inserted
), s AS (
    INSERT INTO webhook_secret (tenant_id, secret) SELECT id, @first_secret FROM t WHERE inserted
    RETURNING id
), k AS (
    INSERT INTO api_key (tenant_id, key_hash, prefix) SELECT id, @key_hash, @prefix FROM t
    RETURNING id
)
SELECT (SELECT id FROM k) AS key_id, EXISTS (SELECT 1 FROM s) AS secret_created;

-- name: lookup_api_key
-- The tenant and limits of a live key. $1 key hash.
SELECT k.tenant_id, t.max_pending, t.submits_per_minute, t.max_priority
FROM api_key k JOIN tenant t ON t.id = k.tenant_id
WHERE k.key_hash = $1 AND k.revoked_at IS NULL;

-- name: revoke_api_key
-- Revokes tenant keys and admin credentials by prefix (as listed); tenant_id is an admin credential's name. $1 prefix.
WITH k AS (
    UPDATE api_key SET revoked_at = now() WHERE prefix = $1 AND revoked_at IS NULL RETURNING id, tenant_id
), a AS (
    UPDATE admin_credential SET revoked_at = now() WHERE prefix = $1 AND revoked_at IS NULL RETURNING id, name
)
SELECT id, tenant_id FROM k UNION ALL SELECT id, name FROM a;

-- name: list_api_keys
-- Every tenant key and admin credential (of one tenant or admin name unless $1 is NULL), newest first, without
-- secrets; scope and expires_at are an admin credential's. $1 tenant or admin name.
SELECT k.id, k.tenant_id, k.prefix, false AS is_admin, NULL::text AS scope, NULL::timestamptz AS expires_at,
       k.created_at, k.revoked_at
FROM api_key k WHERE $1::text IS NULL OR k.tenant_id = $1
UNION ALL
SELECT a.id, a.name, a.prefix, true, a.scope, a.expires_at, a.created_at, a.revoked_at
FROM admin_credential a WHERE $1::text IS NULL OR a.name = $1
ORDER BY created_at DESC, id DESC;

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
-- tenant.
UPDATE tenant SET max_pending = COALESCE(@max_pending, max_pending), submits_per_minute = COALESCE(@submits_per_minute, submits_per_minute),
                  max_priority = COALESCE(@max_priority, max_priority), share_weight = COALESCE(@share_weight, share_weight),
                  gpu_seconds_per_day = NULLIF(COALESCE(@gpu_seconds_per_day, gpu_seconds_per_day), 0),
                  gpu_seconds_per_month = NULLIF(COALESCE(@gpu_seconds_per_month, gpu_seconds_per_month), 0),
                  max_pending_per_end_user = COALESCE(@max_pending_per_end_user, max_pending_per_end_user),
                  submits_per_minute_per_end_user = COALESCE(@submits_per_minute_per_end_user, submits_per_minute_per_end_user),
                  tokens_per_day = NULLIF(COALESCE(@tokens_per_day, tokens_per_day), 0),
                  tokens_per_month = NULLIF(COALESCE(@tokens_per_month, tokens_per_month), 0)
WHERE id = @tenant_id
RETURNING id, max_pending, submits_per_minute, max_priority, share_weight, gpu_seconds_per_day, gpu_seconds_per_month,
          max_pending_per_end_user, submits_per_minute_per_end_user, tokens_per_day, tokens_per_month;

-- name: tenant_exists
-- Whether a tenant exists. $1 tenant.
SELECT EXISTS (SELECT 1 FROM tenant WHERE id = $1);

-- name: create_admin_credential
-- An admin credential; @expires_in_seconds NULL: it never expires.
INSERT INTO admin_credential (name, key_hash, prefix, scope, expires_at)
VALUES (@name, @key_hash, @prefix, @scope, now() + make_interval(secs => @expires_in_seconds))
RETURNING id, expires_at;

-- name: lookup_admin_credential
-- An unrevoked admin credential by key hash, expired or not (the caller says which). $1 key hash.
SELECT id, name, prefix, scope, expires_at, expires_at IS NOT NULL AND expires_at <= now() AS expired
FROM admin_credential WHERE key_hash = $1 AND revoked_at IS NULL;

-- name: insert_admin_audit
-- One admin action as it was asked for (@admin: the admin credential's name).
INSERT INTO admin_audit (admin, prefix, action, target, dry_run, detail) VALUES (@admin, @prefix, @action, @target, @dry_run, @detail)
RETURNING id, at;

-- name: list_admin_audit
-- Admin actions, newest first, keyset-paged on id: $1 the last id seen (NULL: first page), $2 admin name (NULL: all),
-- $3 limit.
SELECT id, at, admin, prefix, action, target, dry_run, detail FROM admin_audit
WHERE ($1::bigint IS NULL OR id < $1) AND ($2::text IS NULL OR admin = $2)
ORDER BY id DESC
LIMIT $3;

-- name: client_token_keys
-- A tenant's client-token key ids still valid, newest first, with how long each is (NULL: current). $1 tenant.
SELECT kid, valid_until, now() AS now FROM client_token_key
WHERE tenant_id = $1 AND (valid_until IS NULL OR valid_until > now())
ORDER BY created_at DESC, kid;

-- name: client_token_key_current
-- The tenant's current client-token key id, made (as $2) when it has none. $1 tenant, $2 a new id.
WITH made AS (
    INSERT INTO client_token_key (tenant_id, kid)
    SELECT $1, $2 WHERE NOT EXISTS (SELECT 1 FROM client_token_key WHERE tenant_id = $1 AND valid_until IS NULL)
    ON CONFLICT DO NOTHING
    RETURNING kid, created_at
)
SELECT kid FROM (SELECT kid, created_at FROM made
                 UNION ALL
                 SELECT kid, created_at FROM client_token_key WHERE tenant_id = $1 AND valid_until IS NULL) k
ORDER BY created_at DESC LIMIT 1;

-- name: client_token_key_rotate
-- A new current client-token key id ($2) for a tenant; the ones current before stay valid for $3 seconds. Under the
-- tenant's row lock, so two rotations do not both leave a current id. $1 tenant.
WITH t AS (SELECT id FROM tenant WHERE id = $1 FOR UPDATE),
retired AS (
    UPDATE client_token_key k SET valid_until = now() + make_interval(secs => $3)
    FROM t WHERE k.tenant_id = t.id AND (k.valid_until IS NULL OR k.valid_until > now() + make_interval(secs => $3))
    RETURNING k.kid
)
INSERT INTO client_token_key (tenant_id, kid) SELECT t.id, $2 FROM t
RETURNING kid, (SELECT count(*) FROM retired) AS retired, now() + make_interval(secs => $3) AS previous_valid_until;
