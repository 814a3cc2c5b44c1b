-- Submit's admission, per batch: one call of submit_tasks admits every submission of a batch (the SubmitTask calls
-- that arrived together, or one SubmitTasks call) in one statement: rate slots, tenant locks, idempotent lookups,
-- pending limits, GPU-second budgets and one multi-row insert (whose history the statement-level trigger writes in
-- one INSERT). Each
-- item's answer is what admitting the items one by one, in array order, would have given: a replay of a key answers
-- with the existing task before any refusal (it takes no rate slot and is never over a limit), the rate slot is
-- counted before the task table is written (a rate-limited item inserts nothing), the tenant row lock serialises one
-- tenant's submissions on every replica (the pending count and the budget cannot race), and a later copy of a key new in the batch
-- answers with the first copy's task or shares its refusal (it takes no slot of its own). Each
-- statement below takes a fresh snapshot (VOLATILE, READ COMMITTED), so the lookups after the locks see every insert
-- committed before them.
--
-- Submissions arrive as one array of rows with named fields (p_items: a JSON array of admission_item objects); each
-- step unnests only the fields it reads, and insert_tasks' column list is the one place that names every column. A text[]
-- per item cannot be an array element, so callback_events travel comma-joined. take_rate_slots is the one rate rule
-- (also called alone, for the slots taken before a callback URL is resolved); insert_tasks is the one author of task
-- rows (test rows and an operator's replays call it directly, without the limits).
--
-- submit_tasks and take_rate_slots_each run their statements with generic plans (SET plan_cache_mode): each statement
-- reads plpgsql variables, i.e. parameters, and under the default 'auto' mode PostgreSQL kept planning every one of
-- them afresh on every call (the custom plans of a one-element array look cheaper than the generic plan's estimate),
-- which was most of a one-submission call's cost (about 5 of its 6.5 ms; 1.6 ms with generic plans). The generic
-- plans are the index lookups the custom ones were, at any batch size.

-- The one rate rule: each submission, in order, of one tenant's end users ('' for the tenant itself) takes a place
-- in its end user's current one-minute window (up to p_per_end_user) and in the tenant's (up to p_per_minute); the
-- end user's own limit is checked first. Under the tenant window's row lock, then its end users' in name order (one
-- order on every replica: no deadlock). Drops the tenant's old windows. Returns one element per submission: NULL
-- when counted, else the limit that refused it ('end_user' or 'tenant').
CREATE OR REPLACE FUNCTION take_rate_slots_each(p_tenant text, p_per_minute integer, p_end_users text[],
                                                p_per_end_user integer) RETURNS text[]
LANGUAGE plpgsql VOLATILE SET plan_cache_mode = force_generic_plan AS $$
DECLARE
    w timestamptz := date_trunc('minute', now());
    used integer;
    got integer := 0;
    names text[];
    counts integer[];
    k integer;
    e text;
    verdicts text[] := '{}';
BEGIN
    DELETE FROM rate_window WHERE tenant_id = p_tenant AND window_start < w - interval '10 minutes';
    INSERT INTO rate_window (tenant_id, window_start, count) VALUES (p_tenant, w, 0) ON CONFLICT DO NOTHING;
    SELECT rw.count INTO used FROM rate_window rw WHERE rw.tenant_id = p_tenant AND rw.window_start = w FOR UPDATE;
    names := ARRAY(SELECT DISTINCT u FROM unnest(p_end_users) u WHERE u <> '' ORDER BY 1);
    IF cardinality(names) > 0 THEN
        DELETE FROM end_user_rate_window ew WHERE ew.tenant_id = p_tenant AND ew.window_start < w;
        INSERT INTO end_user_rate_window (tenant_id, end_user, window_start, count)
        SELECT p_tenant, u, w, 0 FROM unnest(names) u ORDER BY u ON CONFLICT DO NOTHING;
        SELECT array_agg(x.count ORDER BY x.end_user) INTO counts
        FROM (SELECT ew.end_user, ew.count FROM end_user_rate_window ew
              WHERE ew.tenant_id = p_tenant AND ew.window_start = w AND ew.end_user = ANY(names)
              ORDER BY ew.end_user FOR UPDATE) x;
    END IF;
    FOREACH e IN ARRAY p_end_users LOOP
        k := CASE WHEN e <> '' THEN array_position(names, e) END;
        IF k IS NOT NULL AND counts[k] >= p_per_end_user THEN
            verdicts := array_append(verdicts, 'end_user');
        ELSIF used + got >= p_per_minute THEN
            verdicts := array_append(verdicts, 'tenant');
        ELSE
            verdicts := array_append(verdicts, NULL::text);
            got := got + 1;
            IF k IS NOT NULL THEN
                counts[k] := counts[k] + 1;
            END IF;
        END IF;
    END LOOP;
    IF got > 0 THEN
        UPDATE rate_window rw SET count = rw.count + got WHERE rw.tenant_id = p_tenant AND rw.window_start = w;
        UPDATE end_user_rate_window ew SET count = c.n
        FROM unnest(names, counts) c(end_user, n)
        WHERE ew.tenant_id = p_tenant AND ew.window_start = w AND ew.end_user = c.end_user AND ew.count <> c.n;
    END IF;
    RETURN verdicts;
END;
$$;

-- Counts up to p_count of the tenant's own submissions (no end user: an input upload) in its current minute
-- window, by the one rate rule above. Returns how many were counted.
CREATE OR REPLACE FUNCTION take_rate_slots(p_tenant text, p_per_minute integer, p_count integer) RETURNS integer
LANGUAGE sql VOLATILE AS $$
    SELECT count(*)::integer
    FROM unnest(take_rate_slots_each(p_tenant, p_per_minute, array_fill(''::text, ARRAY[p_count]), 1)) v
    WHERE v IS NULL;
$$;

-- Seconds until the current rate window ends (what a rate-limited submission waits).
CREATE OR REPLACE FUNCTION rate_window_left() RETURNS float8
LANGUAGE sql STABLE AS $$
    SELECT extract(epoch FROM date_trunc('minute', now()) + interval '1 minute' - now())::float8;
$$;

-- New tasks in CREATED (the history trigger records version 1 of each), one per array element; an item whose
-- idempotency key is taken is skipped, and so is an element whose p_admit is false. p_replay_of: the task each one
-- replays (an operator's replay of a FAILED or TIMEOUT task; NULL for a submission). p_gpu_reserved and
-- p_budget_day: the GPU-seconds each reserves of its tenant's budget and the UTC day they are charged to (NULL: no
-- budget); p_tokens_reserved and p_token_budget_day: the same of its tenant's token budget. Returns the rows
-- inserted.
CREATE OR REPLACE FUNCTION insert_tasks(
    p_id bigint[], p_user_id text[], p_idempotency_key text[], p_idempotency_derived boolean[], p_request_hash text[],
    p_task_type text[], p_model_id text[], p_prompt text[], p_request_payload jsonb[], p_metadata jsonb[],
    p_priority smallint[], p_queue_name text[], p_max_retries integer[], p_callback_url text[], p_callback_events text[],
    p_trace_context jsonb[], p_start_after timestamptz[] DEFAULT NULL, p_max_queue_seconds float8[] DEFAULT NULL,
    p_admit boolean[] DEFAULT NULL, p_replay_of bigint[] DEFAULT NULL,
    p_gpu_reserved float8[] DEFAULT NULL, p_budget_day date[] DEFAULT NULL, p_end_user text[] DEFAULT NULL,
    p_tokens_reserved bigint[] DEFAULT NULL, p_token_budget_day date[] DEFAULT NULL
) RETURNS SETOF task
LANGUAGE sql VOLATILE AS $$
    INSERT INTO task (id, user_id, idempotency_key, idempotency_derived, request_hash, task_type, model_id, prompt,
                      request_payload, metadata, priority, queue_name, max_retries, callback_url, callback_events,
                      callback_status, last_actor, trace_context, replay_of, gpu_reserved, budget_day,
                      start_after, not_before, max_queue_seconds, queue_expires_at, end_user, tokens_reserved,
                      token_budget_day)
    SELECT i.id, i.user_id, i.idempotency_key, i.idempotency_derived, i.request_hash, i.task_type, i.model_id, i.prompt,
           i.request_payload, i.metadata, i.priority, i.queue_name, i.max_retries, i.callback_url,
           coalesce(string_to_array(nullif(i.callback_events, ''), ','), '{}'),
           CASE WHEN i.callback_url IS NULL THEN 'NONE' ELSE 'PENDING' END, 'submit', i.trace_context, i.replay_of,
           coalesce(i.gpu_reserved, 0), i.budget_day,
           i.start_after, CASE WHEN i.start_after > now() THEN i.start_after END, i.max_queue_seconds,
           greatest(now(), i.start_after) + make_interval(secs => i.max_queue_seconds), coalesce(i.end_user, ''),
           coalesce(i.tokens_reserved, 0), i.token_budget_day
    FROM unnest(p_id, p_user_id, p_idempotency_key, p_idempotency_derived, p_request_hash, p_task_type, p_model_id,
                p_prompt, p_request_payload, p_metadata, p_priority, p_queue_name, p_max_retries, p_callback_url,
                p_callback_events, p_trace_context,
                coalesce(p_start_after, array_fill(NULL::timestamptz, ARRAY[cardinality(p_id)])),
                coalesce(p_max_queue_seconds, array_fill(NULL::float8, ARRAY[cardinality(p_id)])),
                coalesce(p_admit, array_fill(true, ARRAY[cardinality(p_id)])),
                coalesce(p_replay_of, array_fill(NULL::bigint, ARRAY[cardinality(p_id)])),
                coalesce(p_gpu_reserved, array_fill(NULL::float8, ARRAY[cardinality(p_id)])),
                coalesce(p_budget_day, array_fill(NULL::date, ARRAY[cardinality(p_id)])),
                coalesce(p_end_user, array_fill(''::text, ARRAY[cardinality(p_id)])),
                coalesce(p_tokens_reserved, array_fill(NULL::bigint, ARRAY[cardinality(p_id)])),
                coalesce(p_token_budget_day, array_fill(NULL::date, ARRAY[cardinality(p_id)])))
         AS i(id, user_id, idempotency_key, idempotency_derived, request_hash, task_type, model_id, prompt,
              request_payload, metadata, priority, queue_name, max_retries, callback_url, callback_events,
              trace_context, start_after, max_queue_seconds, admit, replay_of, gpu_reserved, budget_day, end_user,
              tokens_reserved, token_budget_day)
    WHERE i.admit
    ON CONFLICT (user_id, end_user, idempotency_key) DO NOTHING
    RETURNING *;
$$;

-- One row per item, in array order: ord (1-based), outcome ('rate_limited' | 'no_tenant' | 'too_many_pending' |
-- 'quota_exceeded' | 'existing' | 'created'), retry_after (seconds, rate_limited and quota_exceeded), pending_limit
-- (the limit that applied), budget_window ('day' | 'month'), budget_left (what is left in it, in its unit),
-- gpu_estimate, budget_unit ('gpu_seconds' | 'tokens') and token_estimate (quota_exceeded only), limit_scope and
-- rate_limit (which limit refused it: 'end_user' or 'tenant', and a rate limit's allowance), task_row (the task
-- created or found, else NULL). p_items: the batch, a JSON array of admission_item objects (each item's per_minute:
-- its tenant's limit, NULL when its rate slot is already taken; gpu_estimate: its model's GPU-seconds when its
-- history has none; token_estimate: the tokens a chat task reserves, NULL for other task types); p_history_seconds
-- and p_history_runs: the run history an estimate reads (as the ETA's); p_now: the budgets' clock (NULL: now()),
-- which tests set.
--
-- Budgets (tenants with gpu_seconds_per_day or _per_month only): under the tenant lock, each item that would be
-- admitted, in array order, reserves its estimate (the median metered device seconds of its model's recent
-- successful runs of its task type and size class, else p_gpu_estimate) while its UTC day's and month's charges leave
-- room, and is refused 'quota_exceeded' otherwise (reserving nothing); the reservation is charged to budget_charge in
-- this statement and settled to the measured seconds when the task ends (functions/usage.sql). Token budgets
-- (tokens_per_day, tokens_per_month) the same way: an item with a token_estimate reserves it while the day's and
-- month's token charges leave room (after its GPU-seconds fit), refused 'quota_exceeded' with budget_unit 'tokens'
-- otherwise; settled to the tokens the task's row records when it ends.
CREATE OR REPLACE FUNCTION submit_tasks(
    p_items jsonb, p_default_max_pending integer,
    p_history_seconds float8 DEFAULT 86400, p_history_runs integer DEFAULT 20, p_now timestamptz DEFAULT NULL,
    p_default_max_pending_per_end_user integer DEFAULT 3, p_default_per_minute_per_end_user integer DEFAULT 30
)
RETURNS TABLE (ord integer, outcome text, retry_after float8, pending_limit integer, budget_window text,
               budget_left float8, gpu_estimate float8, limit_scope text, rate_limit integer, task_row task,
               budget_unit text, token_estimate bigint)
LANGUAGE plpgsql VOLATILE SET plan_cache_mode = force_generic_plan AS $$
#variable_conflict use_column
DECLARE
    -- the batch's fields, each once as the column the steps below unnest (each step reads only the fields it needs)
    p_id bigint[];
    p_user_id text[];
    p_end_user text[];
    p_idempotency_key text[];
    p_idempotency_derived boolean[];
    p_request_hash text[];
    p_task_type text[];
    p_model_id text[];
    p_prompt text[];
    p_request_payload jsonb[];
    p_metadata jsonb[];
    p_priority smallint[];
    p_queue_name text[];
    p_max_retries integer[];
    p_callback_url text[];
    p_callback_events text[];
    p_trace_context jsonb[];
    p_start_after timestamptz[];
    p_max_queue_seconds float8[];
    p_per_minute integer[];
    p_gpu_estimate float8[];
    p_token_estimate bigint[];
    r record;
    seen boolean[];
    v_now timestamptz := coalesce(p_now, now());
    v_day date := (coalesce(p_now, now()) AT TIME ZONE 'UTC')::date;
    v_month date := date_trunc('month', (coalesce(p_now, now()) AT TIME ZONE 'UTC'))::date;
    per_days float8[];
    per_months float8[];
    day_left float8[];
    month_left float8[];
    token_days bigint[];
    token_months bigint[];
    token_day_left bigint[];
    token_month_left bigint[];
    v_units text[];
    pending_left bigint[];
    v_n integer;
    v_end_user text[];  -- each item's end user ('': the tenant itself)
    v_t integer;
    v_owner integer;
    v_est float8;
    v_tok bigint;
    v_tokens bigint[];
    v_class text;
    known_estimates jsonb := '{}';
    v_estimates float8[];
    v_windows text[];
    v_lefts float8[];
    v_retry float8[];
    slot_ords bigint[] := '{}';
    slot_refusals text[] := '{}';
    slot_tenants text[] := '{}';
    slot_per_end_user integer[] := '{}';
    eu_limits integer[];
    eu_keys text[];
    eu_pendings bigint[];
    eu_left bigint[];
    v_scopes text[];
    v_e integer;
    tenants text[];
    limits integer[];
    pendings bigint[];
    v_outcomes text[];
    v_refs bigint[];
    inserted bigint[];
BEGIN
    -- the batch: one row per submission, its fields named (migrations/0039_admission_rows.sql), read in one pass
    SELECT coalesce(array_agg(i.id ORDER BY e.k), '{}'), array_agg(i.user_id ORDER BY e.k),
           array_agg(coalesce(i.end_user, '') ORDER BY e.k), array_agg(i.idempotency_key ORDER BY e.k),
           array_agg(i.idempotency_derived ORDER BY e.k), array_agg(i.request_hash ORDER BY e.k),
           array_agg(i.task_type ORDER BY e.k), array_agg(i.model_id ORDER BY e.k), array_agg(i.prompt ORDER BY e.k),
           array_agg(i.request_payload ORDER BY e.k), array_agg(i.metadata ORDER BY e.k),
           array_agg(i.priority ORDER BY e.k), array_agg(i.queue_name ORDER BY e.k),
           array_agg(i.max_retries ORDER BY e.k), array_agg(i.callback_url ORDER BY e.k),
           array_agg(coalesce(i.callback_events, '') ORDER BY e.k), array_agg(i.trace_context ORDER BY e.k),
           array_agg(i.start_after ORDER BY e.k), array_agg(i.max_queue_seconds ORDER BY e.k),
           array_agg(i.per_minute ORDER BY e.k), array_agg(i.gpu_estimate ORDER BY e.k),
           array_agg(i.token_estimate ORDER BY e.k)
    INTO p_id, p_user_id, p_end_user, p_idempotency_key, p_idempotency_derived, p_request_hash, p_task_type,
         p_model_id, p_prompt, p_request_payload, p_metadata, p_priority, p_queue_name, p_max_retries, p_callback_url,
         p_callback_events, p_trace_context, p_start_after, p_max_queue_seconds, p_per_minute, p_gpu_estimate,
         p_token_estimate
    FROM jsonb_array_elements(p_items) WITH ORDINALITY e(item, k)
    CROSS JOIN LATERAL jsonb_populate_record(NULL::admission_item, e.item) i;
    v_n := cardinality(p_id);
    v_end_user := p_end_user;

    -- 0. the items that still need a rate slot and whose key already names a task: replays, which take none
    SELECT array_agg(i.per_minute IS NOT NULL
                     AND EXISTS (SELECT 1 FROM task e WHERE e.user_id = i.user_id AND e.end_user = i.end_user
                                                        AND e.idempotency_key = i.key)
                     ORDER BY i.ord)
    INTO seen
    FROM unnest(p_user_id, v_end_user, p_idempotency_key, p_per_minute) WITH ORDINALITY i(user_id, end_user, key, per_minute, ord);

    -- 1. rate slots: each tenant's new keys in array order take what is left of their end users' and its minute
    -- windows (the end users' allowance: the tenant's own, else p_default_per_minute_per_end_user)
    FOR r IN
        SELECT c.user_id AS tenant, min(c.per_minute) AS per_minute, array_agg(c.end_user ORDER BY c.ord) AS end_users,
               array_agg(c.ord ORDER BY c.ord) AS ords,
               coalesce(min(tn.submits_per_minute_per_end_user), p_default_per_minute_per_end_user) AS per_end_user
        FROM (SELECT DISTINCT ON (i.user_id, i.end_user, i.key) i.user_id, i.end_user, i.per_minute, i.ord
              FROM unnest(p_user_id, v_end_user, p_idempotency_key, p_per_minute, seen)
                   WITH ORDINALITY i(user_id, end_user, key, per_minute, seen, ord)
              WHERE i.per_minute IS NOT NULL AND NOT i.seen
              ORDER BY i.user_id, i.end_user, i.key, i.ord) c
        LEFT JOIN tenant tn ON tn.id = c.user_id
        GROUP BY c.user_id ORDER BY c.user_id
    LOOP
        slot_ords := slot_ords || r.ords;
        slot_refusals := slot_refusals || take_rate_slots_each(r.tenant, r.per_minute, r.end_users, r.per_end_user);
        slot_tenants := slot_tenants || r.tenant;
        slot_per_end_user := slot_per_end_user || r.per_end_user;
    END LOOP;

    -- 2a. tenant locks, in one order on every replica, in a statement of their own: a statement that waited for a
    -- lock still reads with the snapshot it began with, so the reads below (pending counts, budget charges) must
    -- begin after the wait to see what the replica that held the lock committed
    PERFORM 1 FROM (SELECT tn.id FROM tenant tn WHERE tn.id = ANY(p_user_id) ORDER BY tn.id FOR UPDATE) locked;

    -- 2. the tenants (locked above); the limits that apply and the tenant's unfinished tasks; a
    -- tenant's budgets (GPU-seconds and tokens) and what its day's and month's charges leave (read only for a tenant
    -- with a budget)
    SELECT array_agg(l.id), array_agg(l.lim), array_agg(coalesce(p.pending, 0)), array_agg(l.per_day),
           array_agg(l.per_month), array_agg(l.per_day - u.day_used), array_agg(l.per_month - u.month_used),
           array_agg(l.eu_lim), array_agg(l.tokens_day), array_agg(l.tokens_month),
           array_agg(l.tokens_day - u.tokens_day_used), array_agg(l.tokens_month - u.tokens_month_used)
    INTO tenants, limits, pendings, per_days, per_months, day_left, month_left, eu_limits, token_days, token_months,
         token_day_left, token_month_left
    FROM (SELECT tn.id, coalesce(tn.max_pending, p_default_max_pending) AS lim, tn.gpu_seconds_per_day AS per_day,
                 tn.gpu_seconds_per_month AS per_month,
                 coalesce(tn.max_pending_per_end_user, p_default_max_pending_per_end_user) AS eu_lim,
                 tn.tokens_per_day AS tokens_day, tn.tokens_per_month AS tokens_month
          FROM tenant tn WHERE tn.id = ANY(p_user_id) ORDER BY tn.id FOR UPDATE) l
    LEFT JOIN tenant_pending p ON p.tenant_id = l.id
    LEFT JOIN LATERAL (
        SELECT coalesce(sum(c.seconds) FILTER (WHERE c.day = v_day), 0) AS day_used,
               coalesce(sum(c.seconds), 0) AS month_used,
               coalesce(sum(c.tokens) FILTER (WHERE c.day = v_day), 0)::bigint AS tokens_day_used,
               coalesce(sum(c.tokens), 0)::bigint AS tokens_month_used
        FROM budget_charge c
        WHERE (l.per_day IS NOT NULL OR l.per_month IS NOT NULL OR l.tokens_day IS NOT NULL
               OR l.tokens_month IS NOT NULL)
          AND c.tenant_id = l.id AND c.day >= v_month AND c.day < (v_month + interval '1 month')::date
    ) u ON true;

    -- 2b. each end user's unfinished tasks, counted under its tenant's lock (so exact across replicas): the partial
    -- index task_end_user_pending_idx holds only unfinished tasks (the predicate of task_holds_pending)
    SELECT array_agg(b.user_id || '/' || b.end_user), array_agg(n.pending)
    INTO eu_keys, eu_pendings
    FROM (SELECT DISTINCT u.user_id, u.end_user FROM unnest(p_user_id, v_end_user) u(user_id, end_user)
          WHERE u.end_user <> '' AND u.user_id = ANY(tenants)) b
    CROSS JOIN LATERAL (
        SELECT count(*) AS pending FROM task t
        WHERE t.user_id = b.user_id AND t.end_user = b.end_user
          AND (t.status IN ('CREATED', 'QUEUED', 'PROCESSING') OR (t.status = 'CANCELED' AND t.lease_expires_at IS NOT NULL))
    ) n;

    -- 3. each item's verdict: key already used, rate slot, tenant, then the pending limits over the batch's new keys
    -- (the end user's first, then the tenant's; an item its end user's limit refuses takes no place of the tenant's)
    WITH raw AS (
        SELECT i.id, i.user_id, i.end_user, i.key, i.ord, i.per_minute, i.seen
        FROM unnest(p_id, p_user_id, v_end_user, p_idempotency_key, p_per_minute, seen)
             WITH ORDINALITY i(id, user_id, end_user, key, per_minute, seen, ord)
    ), counted AS (  -- the items step 1 counted: each new key's first copy
        SELECT DISTINCT ON (raw.user_id, raw.end_user, raw.key) raw.user_id, raw.end_user, raw.key, raw.ord AS first_ord
        FROM raw WHERE raw.per_minute IS NOT NULL AND NOT raw.seen
        ORDER BY raw.user_id, raw.end_user, raw.key, raw.ord
    ), item AS (
        SELECT raw.id, raw.user_id, raw.end_user, raw.key, raw.ord,
               CASE WHEN raw.per_minute IS NOT NULL AND NOT raw.seen THEN s.refusal END AS rate_scope
        FROM raw
        LEFT JOIN counted cn ON cn.user_id = raw.user_id AND cn.end_user = raw.end_user AND cn.key = raw.key
        LEFT JOIN unnest(slot_ords, slot_refusals) s(ord, refusal) ON s.ord = cn.first_ord
    ), known AS (
        SELECT item.*, item.rate_scope IS NULL AS slotted, l.lim, l.pending, l.eu_lim,
               coalesce(ep.pending, 0) AS eu_pending, e.id AS existing_id
        FROM item
        LEFT JOIN unnest(tenants, limits, pendings, eu_limits) l(tenant, lim, pending, eu_lim) ON l.tenant = item.user_id
        LEFT JOIN unnest(eu_keys, eu_pendings) ep(k, pending) ON ep.k = item.user_id || '/' || item.end_user
        LEFT JOIN task e ON e.user_id = item.user_id AND e.end_user = item.end_user AND e.idempotency_key = item.key
    ), firsts AS (  -- the first copy of each new key that got its slot; within its end user's limit or not
        SELECT c.*, c.end_user = '' OR row_number() OVER (PARTITION BY c.user_id, c.end_user ORDER BY c.ord)
                                        <= c.eu_lim - c.eu_pending AS eu_ok
        FROM (SELECT k.*, row_number() OVER (PARTITION BY k.user_id, k.end_user, k.key ORDER BY k.ord) AS nth
              FROM known k WHERE k.slotted AND k.lim IS NOT NULL AND k.existing_id IS NULL) c
        WHERE c.nth = 1
    ), admitted AS (  -- within its end user's limit and then ranked among its tenant's such keys
        SELECT f.*, f.eu_ok AND row_number() OVER (PARTITION BY f.user_id, f.eu_ok ORDER BY f.ord)
                                <= f.lim - f.pending AS admit
        FROM firsts f
    ), owner AS (  -- which limit refused a key: its end user's when the places admitted before it fill it
        SELECT a.*, CASE WHEN a.admit THEN NULL
                         WHEN a.end_user <> '' AND a.eu_pending + coalesce(sum(a.admit::int) OVER (
                                  PARTITION BY a.user_id, a.end_user ORDER BY a.ord
                                  ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING), 0) >= a.eu_lim THEN 'end_user'
                         ELSE 'tenant' END AS scope
        FROM admitted a
    )
    SELECT array_agg(CASE WHEN k.existing_id IS NOT NULL AND k.lim IS NOT NULL THEN 'existing'
                          WHEN NOT k.slotted THEN 'rate_limited'
                          WHEN k.lim IS NULL THEN 'no_tenant'
                          WHEN NOT o.admit THEN 'too_many_pending'
                          WHEN o.id = k.id THEN 'admit'
                          ELSE 'copy' END ORDER BY k.ord),
           array_agg(coalesce(k.existing_id, o.id) ORDER BY k.ord),
           array_agg(CASE WHEN k.existing_id IS NOT NULL AND k.lim IS NOT NULL THEN NULL
                          WHEN NOT k.slotted THEN k.rate_scope
                          WHEN k.lim IS NULL THEN NULL
                          ELSE o.scope END ORDER BY k.ord)
    INTO v_outcomes, v_refs, v_scopes
    FROM known k LEFT JOIN owner o ON o.user_id = k.user_id AND o.end_user = k.end_user AND o.key = k.key;

    -- 3b. budgets: the verdicts of a budgeted tenant's items again, one by one in array order, so that an item refused
    -- for its budget takes neither a pending place nor GPU-seconds nor tokens from the items after it; a later copy of
    -- a key follows its first copy
    IF EXISTS (SELECT 1 FROM unnest(per_days, per_months, token_days, token_months) b(d, m, td, tm)
               WHERE b.d IS NOT NULL OR b.m IS NOT NULL OR b.td IS NOT NULL OR b.tm IS NOT NULL) THEN
        v_estimates := array_fill(NULL::float8, ARRAY[v_n]);
        v_units := array_fill(NULL::text, ARRAY[v_n]);
        v_tokens := array_fill(NULL::bigint, ARRAY[v_n]);
        v_windows := array_fill(NULL::text, ARRAY[v_n]);
        v_lefts := array_fill(NULL::float8, ARRAY[v_n]);
        v_retry := array_fill(NULL::float8, ARRAY[v_n]);
        pending_left := ARRAY(SELECT l.lim - l.pending FROM unnest(limits, pendings) WITH ORDINALITY l(lim, pending, k)
                              ORDER BY l.k);
        eu_left := ARRAY(SELECT eu_limits[array_position(tenants, split_part(e.key, '/', 1))] - e.pending
                         FROM unnest(eu_keys, eu_pendings) WITH ORDINALITY e(key, pending, k) ORDER BY e.k);
        FOR r IN
            SELECT i.k::integer AS k, i.id, i.user_id, i.end_user, i.model_id, i.task_type, i.payload, i.dflt, i.tokens
            FROM unnest(p_id, p_user_id, v_end_user, p_model_id, p_task_type, p_request_payload,
                        coalesce(p_gpu_estimate, array_fill(NULL::float8, ARRAY[v_n])),
                        coalesce(p_token_estimate, array_fill(NULL::bigint, ARRAY[v_n])))
                 WITH ORDINALITY i(id, user_id, end_user, model_id, task_type, payload, dflt, tokens, k)
            WHERE v_outcomes[i.k] IN ('admit', 'copy', 'too_many_pending')
            ORDER BY i.k
        LOOP
            v_t := array_position(tenants, r.user_id);
            CONTINUE WHEN per_days[v_t] IS NULL AND per_months[v_t] IS NULL AND token_days[v_t] IS NULL
                          AND token_months[v_t] IS NULL;
            IF v_refs[r.k] IS DISTINCT FROM r.id AND v_refs[r.k] IS NOT NULL THEN  -- a later copy
                v_owner := array_position(p_id, v_refs[r.k]);
                v_outcomes[r.k] := CASE WHEN v_outcomes[v_owner] = 'admit' THEN 'copy' ELSE v_outcomes[v_owner] END;
                v_windows[r.k] := v_windows[v_owner];
                v_lefts[r.k] := v_lefts[v_owner];
                v_estimates[r.k] := v_estimates[v_owner];
                v_retry[r.k] := v_retry[v_owner];
                v_scopes[r.k] := v_scopes[v_owner];
                v_units[r.k] := v_units[v_owner];
                v_tokens[r.k] := v_tokens[v_owner];
                CONTINUE;
            END IF;
            v_e := CASE WHEN r.end_user <> '' THEN array_position(eu_keys, r.user_id || '/' || r.end_user) END;
            IF v_e IS NOT NULL AND eu_left[v_e] <= 0 THEN
                v_outcomes[r.k] := 'too_many_pending';
                v_scopes[r.k] := 'end_user';
                CONTINUE;
            END IF;
            IF pending_left[v_t] <= 0 THEN
                v_outcomes[r.k] := 'too_many_pending';
                v_scopes[r.k] := 'tenant';
                CONTINUE;
            END IF;
            v_scopes[r.k] := NULL;
            v_est := NULL;
            IF per_days[v_t] IS NOT NULL OR per_months[v_t] IS NOT NULL THEN  -- GPU-seconds: a tenant with such a budget
                v_class := r.model_id || '/' || r.task_type || '/' || task_size_class(r.payload);
                v_est := (known_estimates ->> v_class)::float8;
                IF v_est IS NULL THEN
                    SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY h.seconds) INTO v_est
                    FROM (SELECT s.device_seconds AS seconds FROM task s
                          WHERE s.model_id = r.model_id AND task_size_class(s.request_payload) = task_size_class(r.payload)
                            AND s.status = 'SUCCEEDED' AND NOT s.result_reused AND s.started_at IS NOT NULL
                            AND s.task_type = r.task_type AND s.device_seconds > 0
                            AND s.finished_at > v_now - make_interval(secs => p_history_seconds)
                          ORDER BY s.finished_at DESC
                          LIMIT p_history_runs) h;
                    v_est := coalesce(v_est, r.dflt, 0);
                    known_estimates := known_estimates || jsonb_build_object(v_class, v_est);
                END IF;
            END IF;
            v_estimates[r.k] := v_est;
            -- an item without a token estimate (not a chat task) is never refused for tokens
            v_tok := CASE WHEN token_days[v_t] IS NOT NULL OR token_months[v_t] IS NOT NULL THEN r.tokens END;
            v_tokens[r.k] := v_tok;
            IF v_est > coalesce(month_left[v_t], 'Infinity') THEN
                v_outcomes[r.k] := 'quota_exceeded';
                v_units[r.k] := 'gpu_seconds';
                v_windows[r.k] := 'month';
                v_lefts[r.k] := greatest(month_left[v_t], 0);
                v_retry[r.k] := extract(epoch FROM ((v_month + interval '1 month')::timestamp AT TIME ZONE 'UTC') - v_now);
            ELSIF v_est > coalesce(day_left[v_t], 'Infinity') THEN
                v_outcomes[r.k] := 'quota_exceeded';
                v_units[r.k] := 'gpu_seconds';
                v_windows[r.k] := 'day';
                v_lefts[r.k] := greatest(day_left[v_t], 0);
                v_retry[r.k] := extract(epoch FROM ((v_day + 1)::timestamp AT TIME ZONE 'UTC') - v_now);
            ELSIF v_tok > coalesce(token_month_left[v_t], 9223372036854775807) THEN
                v_outcomes[r.k] := 'quota_exceeded';
                v_units[r.k] := 'tokens';
                v_windows[r.k] := 'month';
                v_lefts[r.k] := greatest(token_month_left[v_t], 0);
                v_retry[r.k] := extract(epoch FROM ((v_month + interval '1 month')::timestamp AT TIME ZONE 'UTC') - v_now);
            ELSIF v_tok > coalesce(token_day_left[v_t], 9223372036854775807) THEN
                v_outcomes[r.k] := 'quota_exceeded';
                v_units[r.k] := 'tokens';
                v_windows[r.k] := 'day';
                v_lefts[r.k] := greatest(token_day_left[v_t], 0);
                v_retry[r.k] := extract(epoch FROM ((v_day + 1)::timestamp AT TIME ZONE 'UTC') - v_now);
            ELSE
                v_outcomes[r.k] := 'admit';
                pending_left[v_t] := pending_left[v_t] - 1;
                IF v_e IS NOT NULL THEN
                    eu_left[v_e] := eu_left[v_e] - 1;
                END IF;
                day_left[v_t] := day_left[v_t] - v_est;
                month_left[v_t] := month_left[v_t] - v_est;
                token_day_left[v_t] := token_day_left[v_t] - coalesce(v_tok, 0);
                token_month_left[v_t] := token_month_left[v_t] - coalesce(v_tok, 0);
            END IF;
        END LOOP;
    END IF;

    -- 4. one insert for every admitted item, and one charge per budgeted tenant for what its admitted items reserve
    -- (GPU-seconds and tokens, each day column set only where that budget applied)
    WITH ins AS (
        SELECT * FROM insert_tasks(
            p_id, p_user_id, p_idempotency_key, p_idempotency_derived, p_request_hash, p_task_type, p_model_id, p_prompt,
            p_request_payload, p_metadata, p_priority, p_queue_name, p_max_retries, p_callback_url, p_callback_events,
            p_trace_context, p_start_after, p_max_queue_seconds,
            ARRAY(SELECT o = 'admit' FROM unnest(v_outcomes) WITH ORDINALITY v(o, k) ORDER BY k), NULL,
            CASE WHEN v_estimates IS NOT NULL THEN
                ARRAY(SELECT CASE WHEN o = 'admit' THEN e END
                      FROM unnest(v_outcomes, v_estimates) WITH ORDINALITY v(o, e, k) ORDER BY k) END,
            CASE WHEN v_estimates IS NOT NULL THEN
                ARRAY(SELECT CASE WHEN o = 'admit' AND e IS NOT NULL THEN v_day END
                      FROM unnest(v_outcomes, v_estimates) WITH ORDINALITY v(o, e, k) ORDER BY k) END,
            v_end_user,
            CASE WHEN v_tokens IS NOT NULL THEN
                ARRAY(SELECT CASE WHEN o = 'admit' THEN t END
                      FROM unnest(v_outcomes, v_tokens) WITH ORDINALITY v(o, t, k) ORDER BY k) END,
            CASE WHEN v_tokens IS NOT NULL THEN
                ARRAY(SELECT CASE WHEN o = 'admit' AND t IS NOT NULL THEN v_day END
                      FROM unnest(v_outcomes, v_tokens) WITH ORDINALITY v(o, t, k) ORDER BY k) END)
    ), charged AS (
        INSERT INTO budget_charge AS c (tenant_id, day, seconds, tokens)
        SELECT ins.user_id, v_day, coalesce(sum(ins.gpu_reserved) FILTER (WHERE ins.budget_day IS NOT NULL), 0),
               coalesce(sum(ins.tokens_reserved) FILTER (WHERE ins.token_budget_day IS NOT NULL), 0)
        FROM ins WHERE ins.budget_day IS NOT NULL OR ins.token_budget_day IS NOT NULL
        GROUP BY ins.user_id ORDER BY ins.user_id
        ON CONFLICT (tenant_id, day) DO UPDATE SET seconds = c.seconds + EXCLUDED.seconds,
                                                   tokens = c.tokens + EXCLUDED.tokens
    )
    SELECT coalesce(array_agg(ins.id), '{}') INTO inserted FROM ins;

    -- 5. the answers; an admitted key that a writer without the tenant lock took first answers with that task
    RETURN QUERY
    SELECT i.ord::integer,
           CASE WHEN i.outcome = 'admit' AND i.ref = ANY(inserted) THEN 'created'
                WHEN i.outcome IN ('admit', 'copy') THEN 'existing'
                ELSE i.outcome END,
           CASE WHEN i.outcome = 'rate_limited' THEN rate_window_left()
                WHEN i.outcome = 'quota_exceeded' THEN v_retry[i.ord::integer] END,
           CASE WHEN i.outcome IN ('rate_limited', 'no_tenant') THEN NULL
                WHEN i.outcome = 'too_many_pending' AND i.scope = 'end_user' THEN l.eu_lim
                ELSE l.lim END,
           CASE WHEN i.outcome = 'quota_exceeded' THEN v_windows[i.ord::integer] END,
           CASE WHEN i.outcome = 'quota_exceeded' THEN v_lefts[i.ord::integer] END,
           CASE WHEN i.outcome = 'quota_exceeded' THEN v_estimates[i.ord::integer] END,
           CASE WHEN i.outcome IN ('rate_limited', 'too_many_pending') THEN i.scope END,
           CASE WHEN i.outcome <> 'rate_limited' THEN NULL
                WHEN i.scope = 'end_user' THEN sl.per_end_user
                ELSE p_per_minute[i.ord::integer] END,
           CASE WHEN i.outcome IN ('admit', 'copy', 'existing') THEN
               coalesce((SELECT t FROM task t WHERE t.id = i.ref),
                        (SELECT t FROM task t WHERE t.user_id = i.user_id AND t.end_user = i.end_user
                                                AND t.idempotency_key = i.key))
           END,
           CASE WHEN i.outcome = 'quota_exceeded' THEN v_units[i.ord::integer] END,
           CASE WHEN i.outcome = 'quota_exceeded' THEN v_tokens[i.ord::integer] END
    FROM unnest(p_user_id, v_end_user, p_idempotency_key, v_outcomes, v_refs, v_scopes)
         WITH ORDINALITY i(user_id, end_user, key, outcome, ref, scope, ord)
    LEFT JOIN unnest(tenants, limits, eu_limits) l(tenant, lim, eu_lim) ON l.tenant = i.user_id
    LEFT JOIN unnest(slot_tenants, slot_per_end_user) sl(tenant, per_end_user) ON sl.tenant = i.user_id
    ORDER BY i.ord;
END;
$$;
