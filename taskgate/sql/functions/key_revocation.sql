-- A revoked API key or admin credential is announced on channel taskgate_key_revoked with its hash as the payload, whatever revoked it
-- (TaskAdmin, taskgate-keys, SQL by hand): each service's authenticator drops its cached answer and ends its open
-- streams at once, instead of honouring it until the cache expires (taskgate.auth.Authenticator.revoked).
CREATE OR REPLACE FUNCTION api_key_revoked_notify() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('taskgate_key_revoked', NEW.key_hash);
    RETURN NULL;
END
$$;

CREATE OR REPLACE TRIGGER api_key_revoked AFTER UPDATE OF revoked_at ON api_key
    FOR EACH ROW WHEN (OLD.revoked_at IS NULL AND NEW.revoked_at IS NOT NULL) EXECUTE FUNCTION api_key_revoked_notify();

CREATE OR REPLACE TRIGGER admin_credential_revoked AFTER UPDATE OF revoked_at ON admin_credential
    FOR EACH ROW WHEN (OLD.revoked_at IS NULL AND NEW.revoked_at IS NOT NULL) EXECUTE FUNCTION api_key_revoked_notify();
