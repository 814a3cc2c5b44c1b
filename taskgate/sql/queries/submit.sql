-- The submit service's queries: rate limits, idempotent inserts, queue positions and listings.

-- name: submit_take_rate_slots
-- Counts submissions in the tenant's and their end users' minute windows, as far as they have room, in one statement
-- (the one rate rule: take_rate_slots_each); one whose idempotency key already names a task of its end user (a
-- replay) takes no slot. $1 tenant, $2 allowed per minute, $3 each submission's key ('': none given), $4 each one's
-- end user ('': the tenant), $5 the default allowed per minute per end user (the tenant's own overrides it). One row
-- per submission, in order: replay, retry_after (NULL when counted or a replay), scope (the limit that refused it:
-- 'end_user' or 'tenant') and rate_limit (that limit's submissions per minute).
WITH item AS (
    SELECT k.ord, k.end_user, e.id IS NOT NULL AS replay
    FROM unnest($3::text[], $4::text[]) WITH ORDINALITY k(key, end_user, ord)
    LEFT JOIN task e ON k.key <> '' AND e.user_id = $1 AND e.end_user = k.end_user AND e.idempotency_key = k.key
), fresh AS (
    SELECT item.ord, item.end_user, row_number() OVER (ORDER BY item.ord) AS n FROM item WHERE NOT item.replay
), per_end_user AS (
    SELECT coalesce((SELECT t.submits_per_minute_per_end_user FROM tenant t WHERE t.id = $1), $5::integer) AS lim
), slots AS (
    SELECT take_rate_slots_each($1, $2, ARRAY(SELECT f.end_user FROM fresh f ORDER BY f.ord), p.lim) AS verdicts,
           p.lim
    FROM per_end_user p
)
SELECT item.replay,
       CASE WHEN s.verdicts[f.n] IS NOT NULL THEN rate_window_left() END AS retry_after,
       s.verdicts[f.n] AS scope,
       CASE s.verdicts[f.n] WHEN 'end_user' THEN s.lim WHEN 'tenant' THEN $2 END AS rate_limit
FROM item LEFT JOIN fresh f ON f.ord = item.ord CROSS JOIN slots s
ORDER BY item.ord;

-- name: submit_insert_tasks
-- New tasks in CREATED without the limits (functions/submit_fast_path.sql): test rows. No row for an item whose
-- idempotency key is taken. $1..$19 the columns, one array element per task (submissions.NewTask.COLUMNS).
SELECT * FROM insert_tasks(
    p_id => $1, p_user_id => $2, p_idempotency_key => $3, p_idempotency_derived => $4, p_request_hash => $5,
    p_task_type => $6, p_model_id => $7, p_prompt => $8, p_request_payload => $9, p_metadata => $10,
    p_priority => $11, p_queue_name => $12, p_max_retries => $13, p_callback_url => $14, p_callback_events => $15,
    p_trace_context => $16, p_start_after => $17, p_max_queue_seconds => $18, p_end_user => $19);

-- name: submit_tasks
-- A batch of submissions in one round trip (functions/submit_fast_path.sql): rate slots, tenant locks, idempotent
-- lookups, pending limits, budgets, one insert. $1 the batch: a JSON array of objects with admission_item's fields
-- (submissions.admission_rows), $2 default max pending, $3 and $4 the history an estimate reads (seconds, runs), $5 the
-- budgets' clock (NULL: now), $6 and $7 the defaults of max pending and submissions per minute per end user (a
-- tenant's own override them). One row per item, in order.
SELECT f.ord, f.outcome, f.retry_after, f.pending_limit, f.budget_window, f.budget_left, f.gpu_estimate, f.limit_scope,
       f.rate_limit, f.budget_unit, f.token_estimate, (f.task_row).*
FROM submit_tasks(
    p_items => $1::jsonb, p_default_max_pending => $2, p_history_seconds => $3, p_history_runs => $4, p_now => $5,
    p_default_max_pending_per_end_user => $6, p_default_per_minute_per_end_user => $7) f;

-- name: submit_queue_created
-- CREATED -> QUEUED for a dispatcher pass whose messages are on JetStream (history: one trigger run for the pass).
-- A task no longer CREATED (a worker's claim outran this, or a cancel) is left as it is and not returned. Committed
-- asynchronously (set_config(..., true) lasts until this statement's commit): a lost mark leaves the task CREATED,
-- which a worker may claim and the scheduler's scan dispatches again. $1 task ids, $2 actor, $3 reason. Returns the
-- columns the move set, not whole rows (the caller has them: decoding each whole row again was ~3% of a submit
-- process's samples in bulk).
UPDATE task t SET status = 'QUEUED', version = t.version + 1, queued_at = now(), updated_at = now(),
       last_actor = $2, last_reason = $3
FROM (SELECT set_config('synchronous_commit', 'off', true)) async_commit
WHERE t.id = ANY($1::bigint[]) AND t.status = 'CREATED'
RETURNING t.id, t.status, t.version, t.queued_at, t.updated_at, t.last_actor, t.last_reason;

-- name: submit_queue_position
-- 1-based rank of a QUEUED task among its model's QUEUED tasks: higher priority first, then older. Two index-only
-- range scans of task_queued_rank_idx (an OR would scan every QUEUED entry of the model). $1 model, $2 priority,
-- $3 queued_at, $4 id.
SELECT (SELECT count(*) FROM task WHERE status = 'QUEUED' AND model_id = $1 AND priority > $2)
     + (SELECT count(*) FROM task WHERE status = 'QUEUED' AND model_id = $1 AND priority = $2
          AND (queued_at, id) < ($3::timestamptz, $4::bigint))
     + 1;

-- name: submit_list_tasks
-- A tenant's tasks, newest first, after a keyset cursor: @statuses NULL = all, @after_at and @after_id the last
-- row's created_at and id (NULL = first page).
SELECT * FROM task
WHERE user_id = @user_id
  AND (@statuses::task_status[] IS NULL OR status = ANY(@statuses::task_status[]))
  AND (@created_after::timestamptz IS NULL OR created_at > @created_after)
  AND (@created_before::timestamptz IS NULL OR created_at < @created_before)
  AND (@after_at::timestamptz IS NULL OR (created_at, id) < (@after_at::timestamptz, @after_id::bigint))
ORDER BY created_at DESC, id DESC
LIMIT @limit;

-- name: submit_keep_input
-- Records a tenant's input image (or marks it used again), before its object is written: under the input's
-- advisory lock, so a retention pass deleting the object of the last row for this sha256 either ran before (and the
-- write that follows puts the object back) or sees this row and keeps it.
INSERT INTO task_input (user_id, sha256, uri, width, height, size_bytes)
SELECT @user_id, @sha256, @uri, @width, @height, @size_bytes FROM (SELECT pg_advisory_xact_lock(hashtextextended('taskgate.input:' || @sha256, 0))) lock
ON CONFLICT (user_id, sha256) DO UPDATE SET last_used_at = now(), uri = EXCLUDED.uri
RETURNING *;

-- name: submit_use_input
-- A tenant's stored input image named by its sha256, marked used now; no row when the tenant has none of that name.
-- $1 user, $2 sha256.
UPDATE task_input SET last_used_at = now() WHERE user_id = $1 AND sha256 = $2 AND content_type = 'image/png'
RETURNING *;

-- name: submit_keep_text
-- Records a tenant's text attachment (or marks it used again), before its object is written, under the input's
-- advisory lock as submit_keep_input. $1 user, $2 sha256, $3 uri, $4 bytes, $5 characters.
INSERT INTO task_input (user_id, sha256, uri, size_bytes, content_type, chars)
SELECT $1, $2, $3, $4, 'text/plain', $5
FROM (SELECT pg_advisory_xact_lock(hashtextextended('taskgate.input:' || $2, 0))) lock
ON CONFLICT (user_id, sha256) DO UPDATE SET last_used_at = now(), uri = EXCLUDED.uri
    WHERE task_input.content_type = 'text/plain'
RETURNING *;

-- name: submit_use_text
-- A tenant's stored text attachment named by its sha256, marked used now; no row when the tenant has none of that
-- name. $1 user, $2 sha256.
UPDATE task_input SET last_used_at = now() WHERE user_id = $1 AND sha256 = $2 AND content_type = 'text/plain'
RETURNING *;

-- name: submit_task_by_key
-- The tenant's task holding an idempotency key for one of its end users, if any (the request a refusal must not
-- hide). $1 user, $2 key, $3 end user ('': the tenant).
SELECT * FROM task WHERE user_id = $1 AND end_user = $3 AND idempotency_key = $2;
