-- Poison tasks: attempts whose worker was lost are counted (a task ends FAILED WORKER_LOST after
-- max_worker_losses of them), and the processing time of earlier attempts is kept so the processing timeout covers
-- a task's whole processing time, not only its latest attempt.
ALTER TABLE task
    ADD COLUMN worker_losses integer NOT NULL DEFAULT 0 CHECK (worker_losses >= 0),
    ADD COLUMN processed_seconds double precision NOT NULL DEFAULT 0 CHECK (processed_seconds >= 0);

-- A soft-cancelled attempt keeps its lease while its worker still runs it (the tenant's pending slot stays taken);
-- the scheduler ends the lapsed ones.
CREATE INDEX task_cancel_hold_idx ON task (lease_expires_at) WHERE status = 'CANCELED' AND lease_expires_at IS NOT NULL;
