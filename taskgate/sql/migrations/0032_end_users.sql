-- The people behind a tenant (#35): each task names the end user it was submitted for, an opaque string of the
-- tenant's ('' = the tenant itself, as every task was before). Idempotency keys are scoped per end user (two end
-- users sending the same key get two tasks); the history rows carry the end user so streams and webhooks can name it
-- and a client token's stream can keep to its own end user's events.
ALTER TABLE task ADD COLUMN end_user text NOT NULL DEFAULT '' CHECK (octet_length(end_user) <= 128);
ALTER TABLE task_event ADD COLUMN end_user text NOT NULL DEFAULT '';

CREATE UNIQUE INDEX task_end_user_key_idx ON task (user_id, end_user, idempotency_key);
ALTER TABLE task DROP CONSTRAINT task_user_id_idempotency_key_key;

-- An end user's unfinished tasks (what the per-end-user pending limit counts under its tenant's lock): the same
-- predicate as task_holds_pending (functions/pending.sql), written out because migrations run before functions.
CREATE INDEX task_end_user_pending_idx ON task (user_id, end_user)
    WHERE status IN ('CREATED', 'QUEUED', 'PROCESSING') OR (status = 'CANCELED' AND lease_expires_at IS NOT NULL);

-- insert_tasks and submit_tasks take each task's end user: new signatures.
DROP FUNCTION IF EXISTS submit_tasks(bigint[], text[], text[], boolean[], text[], text[], text[], text[], jsonb[], jsonb[],
                                     smallint[], text[], integer[], text[], text[], jsonb[], timestamptz[], float8[],
                                     integer[], integer, float8[], float8, integer, timestamptz);
DROP FUNCTION IF EXISTS insert_tasks(bigint[], text[], text[], boolean[], text[], text[], text[], text[], jsonb[], jsonb[],
                                     smallint[], text[], integer[], text[], text[], jsonb[], timestamptz[], float8[],
                                     boolean[], bigint[], float8[], date[]);
