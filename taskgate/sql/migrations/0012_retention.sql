-- Retention: outputs deleted before their task are marked, and the scheduler's retention scans stay index-backed.

-- Set when retention deleted the task's stored output (the row keeps what the output was).
ALTER TABLE task ADD COLUMN result_expired_at timestamptz;

-- finished tasks past their retention, oldest first
CREATE INDEX task_finished_idx ON task (finished_at) WHERE finished_at IS NOT NULL;
-- finished tasks whose output is still stored
CREATE INDEX task_result_kept_idx ON task (finished_at)
    WHERE finished_at IS NOT NULL AND result_uri IS NOT NULL AND result_expired_at IS NULL;
-- history rows past their retention
CREATE INDEX task_event_at_idx ON task_event (at);
-- reusable outputs past their retention
CREATE INDEX reusable_result_created_idx ON reusable_result (created_at);
