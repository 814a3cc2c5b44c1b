-- Per batch, not per task (issue 13).

-- One submission as submit_tasks (functions/submit_fast_path.sql) takes them: a batch is an array of these, so one
-- statement admits every SubmitTask call that arrived together, or every item of one SubmitTasks call.
-- per_minute: the tenant's submissions allowed per minute, NULL when this submission's rate slot was already taken.
CREATE TYPE task_submission AS (
    id bigint, user_id text, idempotency_key text, idempotency_derived boolean, request_hash text, task_type text,
    model_id text, prompt text, request_payload jsonb, metadata jsonb, priority smallint, queue_name text,
    max_retries integer, callback_url text, callback_events text[], per_minute integer);

-- Each tenant's unfinished (CREATED, QUEUED, PROCESSING) tasks, kept by the history triggers in the statement that
-- moves them (functions/task_history.sql), so the pending limit reads one row instead of counting tasks. Not on the
-- tenant row itself: a move then never waits behind a submit that holds the tenant lock.
CREATE TABLE tenant_pending (
    tenant_id text PRIMARY KEY,
    pending   bigint NOT NULL
);

-- submit_tasks replaces the one-at-a-time admission.
DROP FUNCTION IF EXISTS submit_fast_path(bigint, text, text, boolean, text, text, text, text, jsonb, jsonb, smallint, text,
                                         integer, text, text[], integer, integer);
DROP FUNCTION IF EXISTS insert_task(bigint, text, text, boolean, text, text, text, text, jsonb, jsonb, smallint, text, integer,
                                    text, text[]);
