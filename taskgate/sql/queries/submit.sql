-- The submit service's queries: rate limits, idempotent inserts, queue positions and listings.

-- name: submit_take_rate_slots
-- Counts submissions in the tenant's and their end users' minute windows, as far as they have room, in one statement
-- (the one rate rule: take_rate_slots_each); one whose idempotency key already names a task of its end user (a
-- replay) takes no slot. @per_minute the tenant's allowance, @keys each submission's key ('': none given),
-- @end_users each one's end user ('': the tenant), @per_end_user the default allowance per end user (the tenant's own
-- overrides it). One row per submission, in order: replay, retry_after (NULL when counted or a replay), scope (the limit that refused it:
-- 'end_user' or 'tenant') and rate_limit (that limit's submissions per minute).
WITH item AS (
    SELECT k.ord, k.end_user, e.id IS NOT NULL AS replay
    FROM unnest(@keys::text[], @end_users::text[]) WITH ORDINALITY k(key, end_user, ord)
    LEFT JOIN task e ON k.key <> '' AND e.user_id = @tenant AND e.end_user = k.end_user AND e.idempotency_key = k.key
), fresh AS (
    SELECT item.ord, item.end_user, row_number() OVER (ORDER BY item.ord) AS n FROM item WHERE NOT item.replay
), per_end_user AS (
    SELECT coalesce((SELECT t.submits_per_minute_per_end_user FROM tenant t WHERE t.id = @tenant), @per_end_user::integer) AS lim
), slots AS (
    SELECT take_rate_slots_each(@tenant, @per_minute, ARRAY(SELECT f.end_user FROM fresh f ORDER BY f.ord), p.lim) AS verdicts,
           p.lim
    FROM per_end_user p
)
SELECT item.replay,
       CASE WHEN s.verdicts[f.n] IS NOT NULL THEN rate_window_left() END AS retry_after,
       s.verdicts[f.n] AS scope,
       CASE s.verdicts[f.n] WHEN 'end_user' THEN s.lim WHEN 'tenant' THEN @per_minute END AS rate_limit
FROM item LEFT JOIN fresh f ON f.ord = item.ord CROSS JOIN slots s
ORDER BY item.ord;

-- name: submit_insert_tasks
-- New tasks in CREATED without the limits (functions/submit_fast_path.sql): test rows. No row for an item whose
-- idempotency key is taken. One array per column (submissions.COLUMNS), one element per task.
SELECT * FROM insert_tasks(
    p_id => @id, p_user_id => @user_id, p_idempotency_key => @idempotency_key,
    p_idempotency_derived => @idempotency_derived, p_request_hash => @request_hash, p_task_type => @task_type,
    p_model_id => @model_id, p_prompt => @prompt, p_request_payload => @request_payload, p_metadata => @metadata,
    p_priority => @priority, p_queue_name => @queue_name, p_max_retries => @max_retries,
    p_callback_url => @callback_url, p_callback_events => @callback_events, p_trace_context => @trace_context,
    p_start_after => @start_after, p_max_queue_seconds => @max_queue_seconds, p_end_user => @end_user);

-- name: submit_tasks
-- A batch of submissions in one round trip (functions/submit_fast_path.sql): rate slots, tenant locks, idempotent
-- lookups, pending limits, budgets, one insert. @items the batch: a JSON array of objects with admission_item's fields
-- (submissions.admission_rows); @history_seconds and @history_runs the history an estimate reads; @now the budgets'
-- clock (NULL: now); the @default_... limits are a tenant's unless it sets its own. One row per item, in order.
SELECT f.ord, f.outcome, f.retry_after, f.pending_limit, f.budget_window, f.budget_left, f.gpu_estimate, f.limit_scope,
       f.rate_limit, f.budget_unit, f.token_estimate, (f.task_row).*
FROM submit_tasks(
    p_items => @items::jsonb, p_default_max_pending => @default_max_pending, p_history_seconds => @history_seconds,
    p_history_runs => @history_runs, p_now => @now,
    p_default_max_pending_per_end_user => @default_max_pending_per_end_user,
    p_default_per_minute_per_end_user => @default_per_minute_per_end_user) f;

-- name: submit_queue_created
-- CREATED -> QUEUED for a dispatcher pass whose messages are on JetStream (history: one trigger run for the pass).
-- A task no longer CREATED (a worker's claim outran this, or a cancel) is left as it is and not returned. A task whose
-- row another transaction holds is skipped, not waited for: that is nearly always a worker's claim of it (the message
-- outran this move; most do), whose durable commit the pass would otherwise wait for, with every task behind it; a
-- task skipped and still CREATED is claimable as it is and the scheduler's scan queues it. Committed asynchronously
-- (set_config(..., true) lasts until this statement's commit): a lost mark leaves the task CREATED, which a worker
-- may claim and the scheduler's scan dispatches again. $1 task ids, $2 actor, $3 reason. Returns the columns the move
-- set, not whole rows (the caller has them: decoding each whole row again was ~3% of a submit process's samples in
-- bulk).
-- Both sides read task by primary key only: the status is compared as text, which no index of task serves. Compared
-- as the enum, statistics taken while no task was CREATED (the usual state) made each side a walk of every CREATED
-- task in task_end_user_pending_idx, the lock side rerun for each of them: after a bulk burst, 20,000 x 20,000 index
-- entries, 69 s for a pass of 100 (#38, test_queue_move_plan).
UPDATE task t SET status = 'QUEUED', version = t.version + 1, queued_at = now(), updated_at = now(),
       last_actor = $2, last_reason = $3
FROM (SELECT set_config('synchronous_commit', 'off', true)) async_commit,
     (SELECT f.id FROM task f WHERE f.id = ANY($1::bigint[]) AND f.status::text = 'CREATED'
      FOR UPDATE SKIP LOCKED) free
WHERE t.id = free.id AND t.status::text = 'CREATED'
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
-- advisory lock as submit_keep_input.
INSERT INTO task_input (user_id, sha256, uri, size_bytes, content_type, chars)
SELECT @user_id, @sha256, @uri, @size_bytes, 'text/plain', @chars
FROM (SELECT pg_advisory_xact_lock(hashtextextended('taskgate.input:' || @sha256, 0))) lock
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
