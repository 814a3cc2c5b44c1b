-- Admin credentials are their own kind (#22): a named operator's key with a scope and an expiry, accepted by TaskAdmin
-- (and, through it, WorkerControl) only, never by TaskGateway or TaskEvents; and the audit log of what admins did.
CREATE TABLE admin_credential (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    name        text NOT NULL CHECK (name ~ '^[A-Za-z0-9_.@-]{1,64}$'),  -- who holds it: an operator or a tool
    key_hash    text NOT NULL UNIQUE,                                    -- HMAC-SHA256 with the pepper, as api_key's
    prefix      text NOT NULL,
    scope       text NOT NULL CHECK (scope IN ('read', 'operator')),     -- read: look only; operator: also act
    expires_at  timestamptz,                                             -- NULL: until revoked
    created_at  timestamptz NOT NULL DEFAULT now(),
    revoked_at  timestamptz
);
CREATE INDEX admin_credential_prefix_idx ON admin_credential (prefix);

CREATE TABLE admin_audit (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at          timestamptz NOT NULL DEFAULT now(),
    admin       text NOT NULL,          -- the credential's name
    prefix      text NOT NULL,          -- and its prefix (credentials outlive nothing here: no foreign key)
    action      text NOT NULL,          -- the TaskAdmin method, or the worker action it vouched for
    target      text NOT NULL DEFAULT '',
    dry_run     boolean NOT NULL DEFAULT false,
    detail      jsonb NOT NULL DEFAULT '{}'
);
CREATE INDEX admin_audit_at_idx ON admin_audit (at);

-- the admin keys made so far were tenant keys with a flag: they become operator credentials named after their tenant,
-- and stop being tenant keys (api_key.is_admin stays, false, for pods of the previous release during a rollout)
INSERT INTO admin_credential (name, key_hash, prefix, scope, created_at, revoked_at)
SELECT k.tenant_id, k.key_hash, k.prefix, 'operator', k.created_at, k.revoked_at FROM api_key k WHERE k.is_admin;
DELETE FROM api_key WHERE is_admin;
