-- A task's own queue limits (#24): start_after (no claim before it: not_before starts there) and max_queue_seconds
-- (the queue's TTL, counted from the later of admission and start_after: queue_expires_at, after which a task still
-- waiting ends TIMEOUT QUEUE_TTL_EXPIRED instead of running late).
ALTER TABLE task ADD COLUMN start_after timestamptz,
                 ADD COLUMN max_queue_seconds float8 CHECK (max_queue_seconds > 0),
                 ADD COLUMN queue_expires_at timestamptz;
CREATE INDEX task_queue_expiry_idx ON task (queue_expires_at)
    WHERE status = 'QUEUED' AND queue_expires_at IS NOT NULL;

-- insert_tasks and submit_tasks take the two limits: new signatures.
DROP FUNCTION IF EXISTS submit_tasks(bigint[], text[], text[], boolean[], text[], text[], text[], text[], jsonb[], jsonb[],
                                     smallint[], text[], integer[], text[], text[], jsonb[], integer[], integer, float8[],
                                     float8, integer, timestamptz);
DROP FUNCTION IF EXISTS insert_tasks(bigint[], text[], text[], boolean[], text[], text[], text[], text[], jsonb[], jsonb[],
                                     smallint[], text[], integer[], text[], text[], jsonb[], boolean[], bigint[], float8[],
                                     date[]);
