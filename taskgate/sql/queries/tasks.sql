-- Transitions of one task. Every block takes the same first six parameters:
--   $1 task id, $2 allowed source states, $3 expected version (NULL = any), $4 expected attempt (NULL = any),
--   $5 actor, $6 reason
-- and returns the new row plus old_status, or no row when the guard did not match.
-- `t.id = $1` beside `t.id = o.id`: the locking subquery is not flattened, so without it a planner whose statistics
-- still see a small table may merge-join o with a walk of the whole primary key (a claim read 700 pages that way).

-- name: queue_task
-- CREATED -> QUEUED once the dispatch message is on JetStream.
UPDATE task t SET status = 'QUEUED', version = t.version + 1, queued_at = now(), updated_at = now(),
       last_actor = $5, last_reason = $6
FROM (SELECT id, status AS old_status FROM task WHERE id = $1 FOR UPDATE) o
WHERE t.id = $1 AND t.id = o.id AND t.status = ANY($2::task_status[])
  AND ($3::bigint IS NULL OR t.version = $3) AND ($4::int IS NULL OR t.attempt = $4)
RETURNING t.*, o.old_status;

-- name: republish_task
-- QUEUED -> QUEUED: the scheduler sent the dispatch message again.
UPDATE task t SET status = 'QUEUED', version = t.version + 1, publish_count = t.publish_count + 1,
       updated_at = now(), last_actor = $5, last_reason = $6
FROM (SELECT id, status AS old_status FROM task WHERE id = $1 FOR UPDATE) o
WHERE t.id = $1 AND t.id = o.id AND t.status = ANY($2::task_status[])
  AND ($3::bigint IS NULL OR t.version = $3) AND ($4::int IS NULL OR t.attempt = $4)
RETURNING t.*, o.old_status;

-- name: progress_task
-- PROCESSING -> PROCESSING with new progress; renews the lease. $7 progress, $8 lease seconds.
-- A worker writes the same move for all its running attempts at once in worker_beat (worker.sql): change both together.
UPDATE task t SET version = t.version + 1, progress = $7, lease_expires_at = now() + make_interval(secs => $8),
       updated_at = now(), last_actor = $5, last_reason = $6
FROM (SELECT id, status AS old_status FROM task WHERE id = $1 FOR UPDATE) o
WHERE t.id = $1 AND t.id = o.id AND t.status = ANY($2::task_status[])
  AND ($3::bigint IS NULL OR t.version = $3) AND ($4::int IS NULL OR t.attempt = $4)
RETURNING t.*, o.old_status;

-- name: succeed_task
-- PROCESSING -> SUCCEEDED with the result. $7 uri, $8 content type, $9 size, $10 sha256, $11 reused, $12 and $13 the
-- attempt's device and slot seconds (metered, functions/usage.sql), $14 its wasted device seconds; a chat task's
-- answer: $15 its inline text, $16 its whole length, $17 finish reason, $18 input and $19 output tokens (NULL for
-- other task types).
UPDATE task t SET status = 'SUCCEEDED', version = t.version + 1, progress = 100, result_uri = $7,
       device_seconds = t.device_seconds + $12, slot_seconds = t.slot_seconds + $13,
       wasted_seconds = t.wasted_seconds + $14,
       result_content_type = $8, result_size = $9, result_sha256 = $10, result_reused = $11,
       result_text = $15, result_chars = $16, finish_reason = $17,
       input_tokens = COALESCE($18, t.input_tokens), output_tokens = COALESCE($19, t.output_tokens),
       error_code = NULL, error_msg = NULL, lease_expires_at = NULL, finished_at = now(), updated_at = now(),
       last_actor = $5, last_reason = $6
FROM (SELECT id, status AS old_status FROM task WHERE id = $1 FOR UPDATE) o
WHERE t.id = $1 AND t.id = o.id AND t.status = ANY($2::task_status[])
  AND ($3::bigint IS NULL OR t.version = $3) AND ($4::int IS NULL OR t.attempt = $4)
RETURNING t.*, o.old_status;

-- name: fail_task
-- PROCESSING -> FAILED. $7 error code, $8 error message, $9 whether the attempt's worker was lost (counted), $10 and
-- $11 the attempt's device and slot seconds, $12 its wasted device seconds.
UPDATE task t SET status = 'FAILED', version = t.version + 1, error_code = $7, error_msg = $8,
       device_seconds = t.device_seconds + $10, slot_seconds = t.slot_seconds + $11,
       wasted_seconds = t.wasted_seconds + $12,
       worker_losses = t.worker_losses + $9::boolean::int,
       lease_expires_at = NULL, finished_at = now(), updated_at = now(),
       last_actor = $5, last_reason = $6
FROM (SELECT id, status AS old_status FROM task WHERE id = $1 FOR UPDATE) o
WHERE t.id = $1 AND t.id = o.id AND t.status = ANY($2::task_status[])
  AND ($3::bigint IS NULL OR t.version = $3) AND ($4::int IS NULL OR t.attempt = $4)
RETURNING t.*, o.old_status;

-- name: retry_task
-- PROCESSING -> QUEUED after a retryable failure. $7 error code, $8 error message, $9 backoff seconds, $10 and $11
-- the attempt's device and slot seconds, $12 its wasted device seconds (those after its newest checkpoint).
UPDATE task t SET status = 'QUEUED', version = t.version + 1, retry_count = t.retry_count + 1,
       device_seconds = t.device_seconds + $10, slot_seconds = t.slot_seconds + $11,
       wasted_seconds = t.wasted_seconds + $12,
       processed_seconds = t.processed_seconds
           + GREATEST(0, EXTRACT(EPOCH FROM LEAST(now(), t.lease_expires_at) - t.started_at))::float8,
       error_code = $7, error_msg = $8, worker_id = NULL, lease_expires_at = NULL, progress = 0,
       queued_at = now(), publish_count = 0, not_before = now() + make_interval(secs => $9),
       updated_at = now(), last_actor = $5, last_reason = $6
FROM (SELECT id, status AS old_status FROM task WHERE id = $1 FOR UPDATE) o
WHERE t.id = $1 AND t.id = o.id AND t.status = ANY($2::task_status[])
  AND ($3::bigint IS NULL OR t.version = $3) AND ($4::int IS NULL OR t.attempt = $4)
RETURNING t.*, o.old_status;

-- name: release_task
-- PROCESSING -> QUEUED without spending a retry: a lost worker, a drained worker, an operator's requeue.
-- $7 whether the attempt's worker was lost (counted toward max_worker_losses), $8 and $9 the attempt's device and
-- slot seconds (0 when its worker is not the one releasing), $10 its wasted device seconds (after its newest checkpoint),
-- $11 whether it keeps its place in its level's queue (a preempted task: queued_at unchanged), $12 whether the lost
-- worker held other tasks too (a loss in company: counted in company_losses, not toward max_worker_losses). A task
-- whose worker was lost runs alone from then on (migration 0047).
UPDATE task t SET status = 'QUEUED', version = t.version + 1, worker_id = NULL, lease_expires_at = NULL,
       device_seconds = t.device_seconds + $8, slot_seconds = t.slot_seconds + $9,
       wasted_seconds = t.wasted_seconds + $10,
       worker_losses = t.worker_losses + ($7::boolean AND NOT $12::boolean)::int,
       company_losses = t.company_losses + ($7::boolean AND $12::boolean)::int,
       run_alone = t.run_alone OR $7::boolean, alone_for = NULL,
       processed_seconds = t.processed_seconds
           + GREATEST(0, EXTRACT(EPOCH FROM LEAST(now(), t.lease_expires_at) - t.started_at))::float8,
       progress = 0, queued_at = CASE WHEN $11 THEN t.queued_at ELSE now() END, publish_count = 0, not_before = NULL, updated_at = now(),
       last_actor = $5, last_reason = $6
FROM (SELECT id, status AS old_status FROM task WHERE id = $1 FOR UPDATE) o
WHERE t.id = $1 AND t.id = o.id AND t.status = ANY($2::task_status[])
  AND ($3::bigint IS NULL OR t.version = $3) AND ($4::int IS NULL OR t.attempt = $4)
RETURNING t.*, o.old_status;

-- name: cancel_task
-- CREATED/QUEUED/PROCESSING -> CANCELED. $7 mode ('soft' or 'hard'). A derived idempotency key is released so an
-- identical later request makes a new task (which may reuse a soft-cancelled run's output). A soft cancel of a live
-- attempt keeps its lease: the worker still runs it (and holds a pending slot, functions/pending.sql) until it lets go.
UPDATE task t SET status = 'CANCELED', version = t.version + 1, cancel_mode = $7,
       lease_expires_at = CASE WHEN $7 = 'soft' AND t.status = 'PROCESSING' AND t.lease_expires_at >= now()
                               THEN t.lease_expires_at END,
       idempotency_key = CASE WHEN t.idempotency_derived THEN t.idempotency_key || '#canceled-' || t.id
                              ELSE t.idempotency_key END,
       finished_at = now(), updated_at = now(),
       last_actor = $5, last_reason = $6
FROM (SELECT id, status AS old_status FROM task WHERE id = $1 FOR UPDATE) o
WHERE t.id = $1 AND t.id = o.id AND t.status = ANY($2::task_status[])
  AND ($3::bigint IS NULL OR t.version = $3) AND ($4::int IS NULL OR t.attempt = $4)
RETURNING t.*, o.old_status;

-- name: timeout_task
-- QUEUED/PROCESSING -> TIMEOUT. $7 error code, $8 error message.
UPDATE task t SET status = 'TIMEOUT', version = t.version + 1, error_code = $7, error_msg = $8,
       lease_expires_at = NULL, finished_at = now(), updated_at = now(),
       last_actor = $5, last_reason = $6
FROM (SELECT id, status AS old_status FROM task WHERE id = $1 FOR UPDATE) o
WHERE t.id = $1 AND t.id = o.id AND t.status = ANY($2::task_status[])
  AND ($3::bigint IS NULL OR t.version = $3) AND ($4::int IS NULL OR t.attempt = $4)
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
WHERE id = $1 AND attempt = $2 AND status = 'CANCELED' AND lease_expires_at IS NOT NULL
RETURNING id;

-- name: insert_dead_letter
-- Records why a task was failed for good. $1 task id, $2 reason, $3 error code, $4 error message.
INSERT INTO dead_letter (task_id, reason, error_code, error_msg) VALUES ($1, $2, $3, $4)
ON CONFLICT (task_id) DO NOTHING;
