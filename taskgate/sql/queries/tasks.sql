-- Transitions of one task. Every block takes the same guard (store.tasks.Guard):
--   @task_id, @sources the allowed source states, @expected_version (NULL = any), @expected_attempt (NULL = any),
--   @actor, @reason
-- and returns the new row plus old_status, or no row when the guard did not match.
-- `t.id = @task_id` beside `t.id = o.id`: the locking subquery is not flattened, so without it a planner whose
-- statistics still see a small table may merge-join o with a walk of the whole primary key (a claim read 700 pages
-- that way). The status is compared as text, which no index of task serves, so t is read by primary key too: compared
-- as the enum, statistics taken while no task was in a source state (a quiet moment, when autoanalyze runs) made
-- each move a walk of every task in that state in a partial index (task_end_user_pending_idx, task_lease_idx...):
-- 20,002 task rows read for one move over 20,000 PROCESSING (#38, test_id_move_plans; the queue move's trap, 92863d7).

-- name: queue_task
-- CREATED -> QUEUED once the dispatch message is on JetStream.
UPDATE task t SET status = 'QUEUED', version = t.version + 1, queued_at = now(), updated_at = now(),
       last_actor = @actor, last_reason = @reason
FROM (SELECT id, status AS old_status FROM task WHERE id = @task_id FOR UPDATE) o
WHERE t.id = @task_id AND t.id = o.id AND t.status::text = ANY(@sources::task_status[]::text[])
  AND (@expected_version::bigint IS NULL OR t.version = @expected_version)
  AND (@expected_attempt::int IS NULL OR t.attempt = @expected_attempt)
RETURNING t.*, o.old_status;

-- name: republish_task
-- QUEUED -> QUEUED: the scheduler sent the dispatch message again.
UPDATE task t SET status = 'QUEUED', version = t.version + 1, publish_count = t.publish_count + 1,
       updated_at = now(), last_actor = @actor, last_reason = @reason
FROM (SELECT id, status AS old_status FROM task WHERE id = @task_id FOR UPDATE) o
WHERE t.id = @task_id AND t.id = o.id AND t.status::text = ANY(@sources::task_status[]::text[])
  AND (@expected_version::bigint IS NULL OR t.version = @expected_version)
  AND (@expected_attempt::int IS NULL OR t.attempt = @expected_attempt)
RETURNING t.*, o.old_status;

-- name: progress_task
-- PROCESSING -> PROCESSING with new progress; renews the lease.
-- A worker writes the same move for all its running attempts at once in worker_beat (worker.sql): change both together.
UPDATE task t SET version = t.version + 1, progress = @percent,
       lease_expires_at = now() + make_interval(secs => @lease_seconds),
       updated_at = now(), last_actor = @actor, last_reason = @reason
FROM (SELECT id, status AS old_status FROM task WHERE id = @task_id FOR UPDATE) o
WHERE t.id = @task_id AND t.id = o.id AND t.status::text = ANY(@sources::task_status[]::text[])
  AND (@expected_version::bigint IS NULL OR t.version = @expected_version)
  AND (@expected_attempt::int IS NULL OR t.attempt = @expected_attempt)
RETURNING t.*, o.old_status;

-- name: succeed_task
-- PROCESSING -> SUCCEEDED with the result; @device_seconds, @slot_seconds and @wasted_seconds the attempt's (metered,
-- functions/usage.sql); a chat task's answer: @text its inline text, @chars its whole length, @finish_reason,
-- @input_tokens and @output_tokens (NULL for other task types).
UPDATE task t SET status = 'SUCCEEDED', version = t.version + 1, progress = 100, result_uri = @uri,
       device_seconds = t.device_seconds + @device_seconds, slot_seconds = t.slot_seconds + @slot_seconds,
       wasted_seconds = t.wasted_seconds + @wasted_seconds,
       result_content_type = @content_type, result_size = @size, result_sha256 = @sha256, result_reused = @reused,
       result_text = @text, result_chars = @chars, finish_reason = @finish_reason,
       input_tokens = COALESCE(@input_tokens, t.input_tokens),
       output_tokens = COALESCE(@output_tokens, t.output_tokens),
       error_code = NULL, error_msg = NULL, lease_expires_at = NULL, finished_at = now(), updated_at = now(),
       last_actor = @actor, last_reason = @reason
FROM (SELECT id, status AS old_status FROM task WHERE id = @task_id FOR UPDATE) o
WHERE t.id = @task_id AND t.id = o.id AND t.status::text = ANY(@sources::task_status[]::text[])
  AND (@expected_version::bigint IS NULL OR t.version = @expected_version)
  AND (@expected_attempt::int IS NULL OR t.attempt = @expected_attempt)
RETURNING t.*, o.old_status;

-- name: fail_task
-- PROCESSING -> FAILED. @worker_lost: the attempt's worker was lost (counted); the attempt's metered seconds.
UPDATE task t SET status = 'FAILED', version = t.version + 1, error_code = @error_code, error_msg = @error_message,
       device_seconds = t.device_seconds + @device_seconds, slot_seconds = t.slot_seconds + @slot_seconds,
       wasted_seconds = t.wasted_seconds + @wasted_seconds,
       worker_losses = t.worker_losses + @worker_lost::boolean::int,
       lease_expires_at = NULL, finished_at = now(), updated_at = now(),
       last_actor = @actor, last_reason = @reason
FROM (SELECT id, status AS old_status FROM task WHERE id = @task_id FOR UPDATE) o
WHERE t.id = @task_id AND t.id = o.id AND t.status::text = ANY(@sources::task_status[]::text[])
  AND (@expected_version::bigint IS NULL OR t.version = @expected_version)
  AND (@expected_attempt::int IS NULL OR t.attempt = @expected_attempt)
RETURNING t.*, o.old_status;

-- name: retry_task
-- PROCESSING -> QUEUED after a retryable failure, not claimable for @delay_seconds; @wasted_seconds the attempt's
-- device seconds after its newest checkpoint.
UPDATE task t SET status = 'QUEUED', version = t.version + 1, retry_count = t.retry_count + 1,
       device_seconds = t.device_seconds + @device_seconds, slot_seconds = t.slot_seconds + @slot_seconds,
       wasted_seconds = t.wasted_seconds + @wasted_seconds,
       processed_seconds = t.processed_seconds
           + GREATEST(0, EXTRACT(EPOCH FROM LEAST(now(), t.lease_expires_at) - t.started_at))::float8,
       error_code = @error_code, error_msg = @error_message, worker_id = NULL, lease_expires_at = NULL, progress = 0,
       queued_at = now(), publish_count = 0, not_before = now() + make_interval(secs => @delay_seconds),
       updated_at = now(), last_actor = @actor, last_reason = @reason
FROM (SELECT id, status AS old_status FROM task WHERE id = @task_id FOR UPDATE) o
WHERE t.id = @task_id AND t.id = o.id AND t.status::text = ANY(@sources::task_status[]::text[])
  AND (@expected_version::bigint IS NULL OR t.version = @expected_version)
  AND (@expected_attempt::int IS NULL OR t.attempt = @expected_attempt)
RETURNING t.*, o.old_status;

-- name: release_task
-- PROCESSING -> QUEUED without spending a retry: a lost worker, a drained worker, an operator's requeue.
-- @worker_lost: the attempt's worker was lost (counted toward max_worker_losses); the attempt's metered seconds (0
-- when its worker is not the one releasing; @wasted_seconds after its newest checkpoint); @keep_order: it keeps its
-- place in its level's queue (a preempted task: queued_at unchanged); @in_company: the lost worker held other tasks
-- too (a loss in company: counted in company_losses, not toward max_worker_losses). A task
-- whose worker was lost runs alone from then on (migration 0047).
UPDATE task t SET status = 'QUEUED', version = t.version + 1, worker_id = NULL, lease_expires_at = NULL,
       device_seconds = t.device_seconds + @device_seconds, slot_seconds = t.slot_seconds + @slot_seconds,
       wasted_seconds = t.wasted_seconds + @wasted_seconds,
       worker_losses = t.worker_losses + (@worker_lost::boolean AND NOT @in_company::boolean)::int,
       company_losses = t.company_losses + (@worker_lost::boolean AND @in_company::boolean)::int,
       run_alone = t.run_alone OR @worker_lost::boolean, alone_for = NULL,
       processed_seconds = t.processed_seconds
           + GREATEST(0, EXTRACT(EPOCH FROM LEAST(now(), t.lease_expires_at) - t.started_at))::float8,
       progress = 0, queued_at = CASE WHEN @keep_order THEN t.queued_at ELSE now() END, publish_count = 0,
       not_before = NULL, updated_at = now(),
       last_actor = @actor, last_reason = @reason
FROM (SELECT id, status AS old_status FROM task WHERE id = @task_id FOR UPDATE) o
WHERE t.id = @task_id AND t.id = o.id AND t.status::text = ANY(@sources::task_status[]::text[])
  AND (@expected_version::bigint IS NULL OR t.version = @expected_version)
  AND (@expected_attempt::int IS NULL OR t.attempt = @expected_attempt)
RETURNING t.*, o.old_status;

-- name: cancel_task
-- CREATED/QUEUED/PROCESSING -> CANCELED. @mode 'soft' or 'hard'. A derived idempotency key is released so an
-- identical later request makes a new task (which may reuse a soft-cancelled run's output). A soft cancel of a live
-- attempt keeps its lease: the worker still runs it (and holds a pending slot, functions/pending.sql) until it lets go.
UPDATE task t SET status = 'CANCELED', version = t.version + 1, cancel_mode = @mode,
       lease_expires_at = CASE WHEN @mode = 'soft' AND t.status = 'PROCESSING' AND t.lease_expires_at >= now()
                               THEN t.lease_expires_at END,
       idempotency_key = CASE WHEN t.idempotency_derived THEN t.idempotency_key || '#canceled-' || t.id
                              ELSE t.idempotency_key END,
       finished_at = now(), updated_at = now(),
       last_actor = @actor, last_reason = @reason
FROM (SELECT id, status AS old_status FROM task WHERE id = @task_id FOR UPDATE) o
WHERE t.id = @task_id AND t.id = o.id AND t.status::text = ANY(@sources::task_status[]::text[])
  AND (@expected_version::bigint IS NULL OR t.version = @expected_version)
  AND (@expected_attempt::int IS NULL OR t.attempt = @expected_attempt)
RETURNING t.*, o.old_status;

-- name: timeout_task
-- QUEUED/PROCESSING -> TIMEOUT.
UPDATE task t SET status = 'TIMEOUT', version = t.version + 1, error_code = @error_code, error_msg = @error_message,
       lease_expires_at = NULL, finished_at = now(), updated_at = now(),
       last_actor = @actor, last_reason = @reason
FROM (SELECT id, status AS old_status FROM task WHERE id = @task_id FOR UPDATE) o
WHERE t.id = @task_id AND t.id = o.id AND t.status::text = ANY(@sources::task_status[]::text[])
  AND (@expected_version::bigint IS NULL OR t.version = @expected_version)
  AND (@expected_attempt::int IS NULL OR t.attempt = @expected_attempt)
RETURNING t.*, o.old_status;

-- name: get_task
-- One task by id.
SELECT * FROM task WHERE id = $1;

-- name: get_tasks
-- The tasks of these ids that exist (primary-key reads).
SELECT * FROM task WHERE id = ANY($1::bigint[]);

-- name: let_go_task
-- The worker stopped running a soft-cancelled attempt: its lease (and pending slot) ends. No new version.
-- $1 id, $2 attempt.
UPDATE task SET lease_expires_at = NULL
WHERE id = $1 AND attempt = $2 AND status::text = 'CANCELED' AND lease_expires_at IS NOT NULL  -- by primary key (above)
RETURNING id;

-- name: insert_dead_letter
-- Records why a task was failed for good. $1 task id, $2 reason, $3 error code, $4 error message.
INSERT INTO dead_letter (task_id, reason, error_code, error_msg) VALUES ($1, $2, $3, $4)
ON CONFLICT (task_id) DO NOTHING;
