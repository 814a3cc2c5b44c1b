-- The submit service's queries: rate limits, idempotent inserts, queue positions and listings.

-- name: submit_take_rate_slots
-- Counts `$3` submissions in the tenant's minute window, one at a time, as far as it has room. $1 tenant, $2 allowed
-- per minute, $3 how many. One row per submission: retry_after NULL when counted.
SELECT take_rate_slot($1, $2) AS retry_after FROM generate_series(1, $3);

-- name: submit_insert_tasks
-- New tasks in CREATED without the limits (functions/submit_fast_path.sql): test rows. No row for an item whose
-- idempotency key is taken. $1 task_submission[] (per_minute unused).
SELECT * FROM insert_tasks($1::task_submission[]);

-- name: submit_tasks
-- A batch of submissions in one round trip (functions/submit_fast_path.sql): rate slots, tenant locks, idempotent
-- lookups, pending limits, one insert. $1 task_submission[] (per_minute NULL: the item's slot is already taken),
-- $2 default max pending. One row per item, in order.
SELECT f.ord, f.outcome, f.retry_after, f.pending_limit, (f.task_row).*
FROM submit_tasks($1::task_submission[], $2) f;

-- name: submit_queue_created
-- CREATED -> QUEUED for a dispatcher pass whose messages are on JetStream (history: one trigger run for the pass).
-- A task no longer CREATED (a worker's claim outran this, or a cancel) is left as it is and not returned. Committed
-- asynchronously (set_config(..., true) lasts until this statement's commit): a lost mark leaves the task CREATED,
-- which a worker may claim and the scheduler's scan dispatches again. $1 task ids, $2 actor, $3 reason.
UPDATE task t SET status = 'QUEUED', version = t.version + 1, queued_at = now(), updated_at = now(),
       last_actor = $2, last_reason = $3
FROM (SELECT set_config('synchronous_commit', 'off', true)) async_commit
WHERE t.id = ANY($1::bigint[]) AND t.status = 'CREATED'
RETURNING t.*;

-- name: submit_queue_position
-- 1-based rank of a QUEUED task among its model's QUEUED tasks: higher priority first, then older. Two index-only
-- range scans of task_queued_rank_idx (an OR would scan every QUEUED entry of the model). $1 model, $2 priority,
-- $3 queued_at, $4 id.
SELECT (SELECT count(*) FROM task WHERE status = 'QUEUED' AND model_id = $1 AND priority > $2)
     + (SELECT count(*) FROM task WHERE status = 'QUEUED' AND model_id = $1 AND priority = $2
          AND (queued_at, id) < ($3::timestamptz, $4::bigint))
     + 1;

-- name: submit_list_tasks
-- A tenant's tasks, newest first, after a keyset cursor. $1 user, $2 statuses (NULL = all), $3 created after,
-- $4 created before, $5 cursor created_at (NULL = first page), $6 cursor id, $7 row limit.
SELECT * FROM task
WHERE user_id = $1
  AND ($2::task_status[] IS NULL OR status = ANY($2::task_status[]))
  AND ($3::timestamptz IS NULL OR created_at > $3)
  AND ($4::timestamptz IS NULL OR created_at < $4)
  AND ($5::timestamptz IS NULL OR (created_at, id) < ($5::timestamptz, $6::bigint))
ORDER BY created_at DESC, id DESC
LIMIT $7;
