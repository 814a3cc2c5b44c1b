-- The submit service's queries: rate limits, idempotent inserts, queue positions and listings.

-- name: submit_take_rate_slot
-- Counts one submission in the tenant's current one-minute window unless it is full; drops the tenant's old windows.
-- $1 tenant, $2 submissions allowed per minute. Returns allowed, and the seconds until the window ends.
WITH w AS (SELECT date_trunc('minute', now()) AS start),
old AS (
    DELETE FROM rate_window WHERE tenant_id = $1 AND window_start < (SELECT start FROM w) - interval '10 minutes'
),
up AS (
    INSERT INTO rate_window AS r (tenant_id, window_start, count) SELECT $1, start, 1 FROM w
    ON CONFLICT (tenant_id, window_start) DO UPDATE SET count = r.count + 1 WHERE r.count < $2
    RETURNING r.count
)
SELECT EXISTS (SELECT 1 FROM up) AS allowed,
       extract(epoch FROM (SELECT start FROM w) + interval '1 minute' - now())::float8 AS retry_after;

-- name: submit_lock_tenant
-- Serialises one tenant's submissions across every replica until the transaction ends. $1 tenant.
SELECT max_pending FROM tenant WHERE id = $1 FOR UPDATE;

-- name: submit_existing_and_pending
-- The task already holding an idempotency key (all columns NULL if none) and the tenant's unfinished task count.
-- $1 tenant, $2 idempotency key. Run after submit_lock_tenant so the count sees every committed insert.
SELECT t.*,
       (SELECT count(*) FROM task p WHERE p.user_id = $1 AND p.status IN ('CREATED', 'QUEUED', 'PROCESSING')) AS pending
FROM (SELECT 1) one LEFT JOIN task t ON t.user_id = $1 AND t.idempotency_key = $2;

-- name: submit_insert_task
-- A new task in CREATED unless its idempotency key is taken (then no row). $1 id, $2 user, $3 idempotency key,
-- $4 key derived, $5 request hash, $6 task type, $7 model, $8 prompt, $9 payload, $10 metadata, $11 priority,
-- $12 queue name, $13 max retries, $14 callback url, $15 callback events.
INSERT INTO task (id, user_id, idempotency_key, idempotency_derived, request_hash, task_type, model_id, prompt,
                  request_payload, metadata, priority, queue_name, max_retries, callback_url, callback_events,
                  callback_status, last_actor)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15,
        CASE WHEN $14::text IS NULL THEN 'NONE' ELSE 'PENDING' END, 'submit')
ON CONFLICT (user_id, idempotency_key) DO NOTHING
RETURNING *;

-- name: submit_fast_path
-- One submission in one round trip (migration 0008): rate slot, tenant lock, idempotent lookup, pending count, insert.
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
