-- Priority preemption: when the scheduler last asked the worker running a task to checkpoint and release it for a
-- waiting task of higher priority (services/scheduler/scans.py PreemptScan); a task is not preempted again within
-- preempt_window_seconds, and a model sees no second preemption while the first one's slot is being taken.
ALTER TABLE task ADD COLUMN preempted_at timestamptz;

CREATE INDEX task_preempted_idx ON task (model_id, preempted_at) WHERE preempted_at IS NOT NULL;
