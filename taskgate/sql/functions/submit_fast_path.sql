-- Submit's fast path: rate slot, tenant lock, idempotent lookup, pending count and insert in one call, so the tenant
-- row lock is held for a single round trip instead of four. Semantics are those of the separate statements it
-- replaced: the rate slot is counted before the task table is touched (a rate-limited call inserts nothing), the
-- tenant row lock serialises one tenant's submissions on every replica (the pending count cannot race), a replay of
-- the key answers with the existing task even at the limit, and each statement below takes a fresh snapshot
-- (VOLATILE, READ COMMITTED), so the lookup and the count after the lock see every insert committed before it.
-- take_rate_slot and insert_task are its two steps that also run alone (a slot taken before validation; test rows).

-- Counts one submission in the tenant's current one-minute window unless it is full; drops the tenant's old windows.
-- Returns NULL when counted, else the seconds until the full window ends.
CREATE OR REPLACE FUNCTION take_rate_slot(p_tenant text, p_per_minute integer) RETURNS float8
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    w timestamptz := date_trunc('minute', now());
BEGIN
    DELETE FROM rate_window WHERE tenant_id = p_tenant AND window_start < w - interval '10 minutes';
    INSERT INTO rate_window AS r (tenant_id, window_start, count) VALUES (p_tenant, w, 1)
    ON CONFLICT (tenant_id, window_start) DO UPDATE SET count = r.count + 1 WHERE r.count < p_per_minute;
    IF FOUND THEN
        RETURN NULL;
    END IF;
    RETURN extract(epoch FROM w + interval '1 minute' - now())::float8;
END;
$$;

-- A new task in CREATED (the history trigger records version 1), or a NULL row when its idempotency key is taken.
CREATE OR REPLACE FUNCTION insert_task(
    p_id bigint, p_user text, p_key text, p_derived boolean, p_hash text, p_type text, p_model text, p_prompt text,
    p_payload jsonb, p_metadata jsonb, p_priority smallint, p_queue text, p_max_retries integer, p_callback_url text,
    p_callback_events text[])
RETURNS task LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    t task;
BEGIN
    INSERT INTO task (id, user_id, idempotency_key, idempotency_derived, request_hash, task_type, model_id, prompt,
                      request_payload, metadata, priority, queue_name, max_retries, callback_url, callback_events,
                      callback_status, last_actor)
    VALUES (p_id, p_user, p_key, p_derived, p_hash, p_type, p_model, p_prompt, p_payload, p_metadata, p_priority,
            p_queue, p_max_retries, p_callback_url, p_callback_events,
            CASE WHEN p_callback_url IS NULL THEN 'NONE' ELSE 'PENDING' END, 'submit')
    ON CONFLICT (user_id, idempotency_key) DO NOTHING
    RETURNING * INTO t;
    RETURN t;
END;
$$;

-- Returns one row: outcome ('rate_limited' | 'no_tenant' | 'too_many_pending' | 'existing' | 'created'),
-- retry_after (seconds, rate_limited only), pending_limit (the limit that applied), task_row (the task, or NULL).
CREATE OR REPLACE FUNCTION submit_fast_path(
    p_id bigint, p_user text, p_key text, p_derived boolean, p_hash text, p_type text, p_model text, p_prompt text,
    p_payload jsonb, p_metadata jsonb, p_priority smallint, p_queue text, p_max_retries integer, p_callback_url text,
    p_callback_events text[], p_per_minute integer, p_default_max_pending integer)
RETURNS TABLE (outcome text, retry_after float8, pending_limit integer, task_row task)
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
DECLARE
    wait float8;
    lim integer;
    pending bigint;
    t task;
BEGIN
    IF p_per_minute IS NOT NULL THEN  -- NULL: the caller already took this submission's rate slot
        wait := take_rate_slot(p_user, p_per_minute);
        IF wait IS NOT NULL THEN
            RETURN QUERY SELECT 'rate_limited'::text, wait, NULL::integer, NULL::task;
            RETURN;
        END IF;
    END IF;

    SELECT tn.max_pending INTO lim FROM tenant tn WHERE tn.id = p_user FOR UPDATE;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'no_tenant'::text, NULL::float8, NULL::integer, NULL::task;
        RETURN;
    END IF;
    lim := coalesce(lim, p_default_max_pending);

    SELECT * INTO t FROM task WHERE user_id = p_user AND idempotency_key = p_key;
    IF FOUND THEN
        RETURN QUERY SELECT 'existing'::text, NULL::float8, lim, t;
        RETURN;
    END IF;

    -- counting stops at the limit: only "at least lim" matters
    SELECT count(*) INTO pending FROM (
        SELECT 1 FROM task WHERE user_id = p_user AND status IN ('CREATED', 'QUEUED', 'PROCESSING') LIMIT lim) p;
    IF pending >= lim THEN
        RETURN QUERY SELECT 'too_many_pending'::text, NULL::float8, lim, NULL::task;
        RETURN;
    END IF;

    t := insert_task(p_id, p_user, p_key, p_derived, p_hash, p_type, p_model, p_prompt, p_payload, p_metadata,
                     p_priority, p_queue, p_max_retries, p_callback_url, p_callback_events);
    IF t.id IS NOT NULL THEN
        RETURN QUERY SELECT 'created'::text, NULL::float8, lim, t;
        RETURN;
    END IF;
    -- a writer that does not take the tenant lock holds the key
    SELECT * INTO t FROM task WHERE user_id = p_user AND idempotency_key = p_key;
    RETURN QUERY SELECT 'existing'::text, NULL::float8, lim, t;
END;
$$;
