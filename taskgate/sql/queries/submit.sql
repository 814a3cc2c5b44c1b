-- The submit service's queries: rate limits, idempotent inserts, queue positions and listings.

-- name: submit_take_rate_slot
-- Counts one submission in the tenant's minute window (functions/submit_fast_path.sql). $1 tenant, $2 submissions
-- allowed per minute. Returns retry_after: NULL when counted, else the seconds until the full window ends.
SELECT take_rate_slot($1, $2) AS retry_after;

-- name: submit_insert_task
-- A new task in CREATED without the limits (functions/submit_fast_path.sql): test rows. Every column NULL when the
-- idempotency key is taken. $1 id .. $15 callback events as in submit_fast_path.
SELECT * FROM insert_task($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15);

-- name: submit_fast_path
-- One submission in one round trip (functions/submit_fast_path.sql): rate slot, tenant lock, idempotent lookup,
-- pending count, insert.
-- $1 id, $2 user, $3 idempotency key, $4 key derived, $5 request hash, $6 task type, $7 model, $8 prompt, $9 payload,
-- $10 metadata, $11 priority, $12 queue name, $13 max retries, $14 callback url, $15 callback events,
-- $16 submissions allowed per minute (NULL: slot already taken), $17 default max pending.
SELECT f.outcome, f.retry_after, f.pending_limit, (f.task_row).*
FROM submit_fast_path($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17) f;

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
