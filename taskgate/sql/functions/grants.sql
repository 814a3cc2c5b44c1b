-- Least privilege inside: what each service's PostgreSQL role may touch, granted again on every migrate (so a table a
-- new migration adds is covered). Only roles that exist get grants: an operator creates the group roles it wants
-- (taskgate_submit, taskgate_scheduler, taskgate_worker, taskgate_notifier, taskgate_http), NOLOGIN, and a login
-- role per service IN ROLE its group; the migrate step runs as the owner. A service role may read and write rows, never
-- change the schema or the migration ledger; the worker never reads API keys or webhook secrets (it checks no key
-- and signs no webhook), and the HTTP face holds no database rights at all.
DO $grants$
DECLARE
    service text;
BEGIN
    FOREACH service IN ARRAY ARRAY['taskgate_submit', 'taskgate_scheduler', 'taskgate_worker', 'taskgate_notifier'] LOOP
        CONTINUE WHEN NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = service);
        EXECUTE format('GRANT USAGE ON SCHEMA %I TO %I', current_schema(), service);
        EXECUTE format('GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA %I TO %I', current_schema(), service);
        EXECUTE format('GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA %I TO %I', current_schema(), service);
        EXECUTE format('REVOKE INSERT, UPDATE, DELETE, TRUNCATE ON schema_migration FROM %I', service);
        EXECUTE format('REVOKE CREATE ON SCHEMA %I FROM %I', current_schema(), service);
    END LOOP;
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'taskgate_worker') THEN
        REVOKE ALL ON api_key, webhook_secret, admin_credential, admin_audit FROM taskgate_worker;
    END IF;
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'taskgate_http') THEN
        EXECUTE format('REVOKE ALL ON ALL TABLES IN SCHEMA %I FROM taskgate_http', current_schema());
    END IF;
END
$grants$;
