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

-- name: submit_queue_many
-- CREATED -> QUEUED for a batch whose dispatch messages are on JetStream (history: one trigger run for the batch),
-- each row with its queue position: the QUEUED tasks of its model ahead of it before the move (two index-only range
-- scans per model and priority, not per task), plus the batch's own tasks ahead of it. A task no longer CREATED is
-- left as it is and not returned. Committed asynchronously (set_config(..., true) lasts until this statement's
-- commit): a lost mark leaves the task CREATED, and the scheduler re-publishes CREATED tasks.
-- $1 task ids, $2 actor, $3 reason.
WITH moved AS (
    UPDATE task t SET status = 'QUEUED', version = t.version + 1, queued_at = now(), updated_at = now(),
           last_actor = $2, last_reason = $3
    WHERE t.id = ANY($1::bigint[]) AND t.status = 'CREATED'
    RETURNING t.*
), ahead AS MATERIALIZED (  -- counted once per model and priority: inlined, the counts ran once per moved row
    SELECT g.model_id, g.priority,
           (SELECT count(*) FROM task q WHERE q.status = 'QUEUED' AND q.model_id = g.model_id AND q.priority > g.priority)
         + (SELECT count(*) FROM task q WHERE q.status = 'QUEUED' AND q.model_id = g.model_id AND q.priority = g.priority
              AND q.queued_at <= now()) AS n
    FROM (SELECT DISTINCT model_id, priority FROM moved) g
)
SELECT m.*, a.n + row_number() OVER (PARTITION BY m.model_id ORDER BY m.priority DESC, m.id) AS queue_position
FROM moved m JOIN ahead a ON a.model_id = m.model_id AND a.priority = m.priority
CROSS JOIN (SELECT set_config('synchronous_commit', 'off', true)) async_commit;

-- name: submit_get_tasks
-- Tasks by id (those a batched move left as they were). $1 task ids.
SELECT * FROM task WHERE id = ANY($1::bigint[]);

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
