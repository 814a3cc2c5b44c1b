-- Step checkpoints: the newest stored snapshot of a task's denoising (services/worker/checkpoint.py), which a later
-- attempt resumes from instead of step 0. Written by the running attempt only (guarded by its attempt number); the
-- object is deleted and the column cleared once the task has ended (by its worker, else the scheduler's retention).
-- wasted_seconds: device seconds its attempts spent on steps that a later attempt had to compute again (metering).
-- checkpoint_garbage: objects named before they were stored, or replaced, not yet known deleted: a worker killed at any
-- point between naming, storing, recording and deleting leaves nothing that no row names.
ALTER TABLE task ADD COLUMN checkpoint_uri text,
                 ADD COLUMN checkpoint_step int NOT NULL DEFAULT 0 CHECK (checkpoint_step >= 0),
                 ADD COLUMN checkpoint_garbage text[] NOT NULL DEFAULT '{}',
                 ADD COLUMN wasted_seconds float8 NOT NULL DEFAULT 0 CHECK (wasted_seconds >= 0);

-- ended tasks whose checkpoints may still be stored
CREATE INDEX task_checkpoint_ended_idx ON task (finished_at)
    WHERE finished_at IS NOT NULL AND (checkpoint_uri IS NOT NULL OR checkpoint_garbage <> '{}');

-- the same per tenant, model and hour (functions/usage.sql)
ALTER TABLE usage_hour ADD COLUMN wasted_seconds float8 NOT NULL DEFAULT 0;
