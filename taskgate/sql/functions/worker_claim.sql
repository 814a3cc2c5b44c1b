-- A worker's claim for one dispatch message, in one statement: the checks, the caps and the guarded claim (the one
-- claim there is: -> PROCESSING as a new attempt, guarded like the moves of queries/tasks.sql). Run as its own transaction.
-- The message is a hint for its task's (model, priority) level, not an assignment: it claims the fairest due QUEUED
-- task of that level (stride scheduling over tenants, migration 0024: the lowest pass wins; a claim advances the
-- tenant's pass by 1 / its share_weight; inside the tenant's turn the same stride over its end users, migration 0035:
-- the end user with the lowest pass wins, its oldest task first, and its pass grows by 1), else its own task while
-- that is still CREATED (the message outran the commit); its own task PROCESSING under a lapsed lease (its worker
-- was lost) is taken over first.
-- Bystanders (migration 0047): a task that lost a worker runs alone from then on (run_alone). A worker that runs such a
-- task claims nothing else ('busy'); an empty worker claims the level's due run_alone task first (before the fair
-- pick); a worker holding tasks reserves it instead (alone_for) and is told to drain ('alone': claimed is that task),
-- unless another live worker already drains for it (then the fair pick, which passes run_alone tasks by). A takeover
-- is one more run alone: only a worker that holds nothing takes one over, and counts the loss as alone or in company
-- (worker_lost_holding); only a loss alone counts toward p_max_losses.
-- verdict: 'claimed' (claimed is the new attempt, old_status what it left), 'not_found', 'other_model', 'capped';
-- with nothing to claim in the level: 'finished' (its own task ended), 'refused' (its own task runs under a live
-- lease, or a takeover would reach p_max_losses or this worker holds other tasks), 'alone' (drain, see above), 'early' (the level's QUEUED tasks are not due yet: wait_seconds until the first is) or
-- 'busy' (every due task is being claimed by others right now); claimed is otherwise the message's own task.
-- reusable: a soft-cancelled run's output for the claimed task's request.
-- plpgsql: each statement takes a fresh snapshot, so the model's count after its lock sees every committed claim.
CREATE OR REPLACE FUNCTION worker_claim(
    p_task_id bigint, p_model_id text, p_cap integer, p_cluster_cap boolean, p_worker_id text, p_lease_seconds float8,
    p_max_losses integer, p_actor text, p_reason text,
    OUT verdict text, OUT old_status task_status, OUT claimed task, OUT reusable reusable_result,
    OUT wait_seconds float8)
LANGUAGE plpgsql AS $$
DECLARE
    v_running bigint;
    v_model_running bigint;
    v_priority smallint;
    v_floor float8;
    v_pick record;
    v_id bigint;
    v_seen boolean := false;
    v_new_floor float8;
    v_eu record;
    v_eu_floor float8;
    v_company boolean := false;
    v_held integer;
    v_alone record;
    v_any_alone boolean;
BEGIN
    -- a claim commits durably (no synchronous_commit=off here): a claim lost in a crash would hand its attempt number
    -- to a second worker, and writes are fenced by that number
    SELECT t.* INTO claimed FROM task t WHERE t.id = p_task_id;
    IF NOT FOUND THEN
        verdict := 'not_found';
        RETURN;
    END IF;
    IF claimed.model_id <> p_model_id THEN
        verdict := 'other_model';
        RETURN;
    END IF;
    v_priority := claimed.priority;
    -- tasks to run alone are few (only after a worker death): one look at their index, usually empty, and the rest of
    -- their checks only when there are some
    v_any_alone := EXISTS (SELECT 1 FROM task a WHERE a.run_alone AND a.status IN ('QUEUED', 'PROCESSING'));
    -- a run alone: this worker takes nothing else while it runs
    IF v_any_alone AND EXISTS (SELECT 1 FROM task a WHERE a.run_alone AND a.status = 'PROCESSING'
                               AND a.worker_id = p_worker_id AND a.lease_expires_at > now()) THEN
        verdict := 'busy';
        RETURN;
    END IF;
    -- each cap is exact: claims queue on its lock until the claiming transaction commits (model first, then cluster,
    -- always in that order, so two claims never wait on each other's)
    IF p_cap > 0 THEN
        PERFORM pg_advisory_xact_lock(hashtextextended('taskgate.model:' || p_model_id, 0));
    END IF;
    -- the cluster's cap: floor of the live workers' summed capacities (a one-GPU worker holds 1.5 of it)
    IF p_cluster_cap THEN
        PERFORM pg_advisory_xact_lock(hashtextextended('taskgate.cluster', 0));
    END IF;
    -- Both caps count live leases from task_live_lease_idx (migration 0017), in one pass after the locks.
    IF p_cluster_cap OR p_cap > 0 THEN
        SELECT count(*), count(*) FILTER (WHERE l.model_id = p_model_id) INTO v_running, v_model_running
        FROM task l
        WHERE task_holds_lease(l.status, l.lease_expires_at) AND l.lease_expires_at > now();
        IF (p_cap > 0 AND v_model_running >= p_cap) OR (p_cluster_cap AND v_running >= (
            SELECT floor(coalesce(sum(coalesce(w.capacity, w.slots)), 0)) FROM worker w
            WHERE w.last_heartbeat > now() - make_interval(secs => p_lease_seconds)
        )) THEN
            verdict := 'capped';
            RETURN;
        END IF;
    END IF;
    IF claimed.status = 'PROCESSING' AND claimed.lease_expires_at < now() AND NOT EXISTS (
        SELECT 1 FROM task l WHERE l.worker_id = p_worker_id AND task_holds_lease(l.status, l.lease_expires_at)
                               AND l.lease_expires_at > now()) THEN
        -- a redelivery after its worker was lost: take the attempt over (this worker holds nothing else), unless the
        -- loss is alone and reaches p_max_losses (the scheduler's lease scan fails it). The row is locked before the
        -- lost worker's registry row, in the lease scan's order (its tasks, then their worker's row): no deadlock.
        PERFORM 1 FROM task t WHERE t.id = p_task_id AND t.status::text = 'PROCESSING' AND t.lease_expires_at < now()
        FOR UPDATE;
        IF FOUND THEN
            v_company := worker_lost_holding(claimed.worker_id) > 1;
            IF v_company OR p_max_losses IS NULL OR claimed.worker_losses + 1 < p_max_losses THEN
                v_id := p_task_id;
            END IF;
        END IF;
    END IF;
    IF v_id IS NULL AND v_any_alone THEN
        -- the level's due run_alone task: this worker's reservation first, then an open one (no live worker drains
        -- for it), oldest first
        SELECT q.id, (q.alone_for IS NULL OR q.alone_for = p_worker_id
                      OR coalesce(w.last_heartbeat <= now() - make_interval(secs => p_lease_seconds), true)) AS open
        INTO v_alone
        FROM task q LEFT JOIN worker w ON w.id = q.alone_for
        WHERE q.run_alone AND q.status = 'QUEUED' AND q.model_id = p_model_id AND q.priority = v_priority
          AND (q.not_before IS NULL OR q.not_before <= now())
          AND (q.queue_expires_at IS NULL OR q.queue_expires_at > now())
        ORDER BY q.alone_for IS NOT DISTINCT FROM p_worker_id DESC,
                 (q.alone_for IS NULL OR coalesce(w.last_heartbeat <= now() - make_interval(secs => p_lease_seconds), true)) DESC,
                 q.queued_at, q.id
        LIMIT 1
        FOR UPDATE OF q SKIP LOCKED;
        IF FOUND THEN
            v_seen := true;
            SELECT count(*) INTO v_held FROM task l
            WHERE l.worker_id = p_worker_id AND task_holds_lease(l.status, l.lease_expires_at) AND l.lease_expires_at > now();
            IF v_held = 0 THEN
                v_id := v_alone.id;  -- an empty worker: it runs alone here
            ELSIF v_alone.open THEN  -- this worker drains for it
                UPDATE task SET alone_for = p_worker_id WHERE id = v_alone.id AND alone_for IS DISTINCT FROM p_worker_id;
                verdict := 'alone';
                SELECT t.* INTO claimed FROM task t WHERE t.id = v_alone.id;
                RETURN;
            END IF;
        END IF;
    END IF;
    IF v_id IS NULL THEN
        SELECT l.floor INTO v_floor FROM fair_level l WHERE l.model_id = p_model_id AND l.priority = v_priority;
        v_floor := coalesce(v_floor, 0);
        -- the tenants with a due QUEUED task in the level (a skip scan of task_fair_idx), lowest pass first
        FOR v_pick IN
            WITH RECURSIVE tenants AS (
                (SELECT q.user_id FROM task q
                 WHERE q.status = 'QUEUED' AND q.model_id = p_model_id AND q.priority = v_priority
                 ORDER BY q.user_id LIMIT 1)
                UNION ALL
                SELECT (SELECT q.user_id FROM task q
                        WHERE q.status = 'QUEUED' AND q.model_id = p_model_id AND q.priority = v_priority
                          AND q.user_id > s.user_id
                        ORDER BY q.user_id LIMIT 1)
                FROM tenants s WHERE s.user_id IS NOT NULL
            )
            SELECT s.user_id, GREATEST(coalesce(f.pass, v_floor), v_floor) AS pass,
                   coalesce(w.share_weight, 1) AS weight, coalesce(f.end_user_floor, 0) AS end_user_floor
            FROM tenants s
            CROSS JOIN LATERAL (
                SELECT q.queued_at, q.id FROM task q
                WHERE q.status = 'QUEUED' AND q.model_id = p_model_id AND q.priority = v_priority
                  AND q.user_id = s.user_id AND (q.not_before IS NULL OR q.not_before <= now())
                  AND (q.queue_expires_at IS NULL OR q.queue_expires_at > now())
                ORDER BY q.queued_at, q.id LIMIT 1
            ) h
            LEFT JOIN fair_share f ON f.model_id = p_model_id AND f.priority = v_priority AND f.user_id = s.user_id
            LEFT JOIN tenant w ON w.id = s.user_id
            WHERE s.user_id IS NOT NULL
            ORDER BY 2, h.queued_at, h.id
        LOOP
            v_seen := true;
            -- inside the tenant's turn: its end users with a due QUEUED task (a skip scan of task_fair_end_user_idx),
            -- lowest pass first ('' is the tenant's own tasks, one end user among the others)
            v_eu_floor := v_pick.end_user_floor;
            FOR v_eu IN
                WITH RECURSIVE users AS (
                    (SELECT q.end_user FROM task q
                     WHERE q.status = 'QUEUED' AND q.model_id = p_model_id AND q.priority = v_priority
                       AND q.user_id = v_pick.user_id
                     ORDER BY q.end_user LIMIT 1)
                    UNION ALL
                    SELECT (SELECT q.end_user FROM task q
                            WHERE q.status = 'QUEUED' AND q.model_id = p_model_id AND q.priority = v_priority
                              AND q.user_id = v_pick.user_id AND q.end_user > u.end_user
                            ORDER BY q.end_user LIMIT 1)
                    FROM users u WHERE u.end_user IS NOT NULL
                )
                SELECT u.end_user, GREATEST(coalesce(e.pass, v_eu_floor), v_eu_floor) AS pass
                FROM users u
                CROSS JOIN LATERAL (
                    SELECT q.queued_at, q.id FROM task q
                    WHERE q.status = 'QUEUED' AND q.model_id = p_model_id AND q.priority = v_priority
                      AND q.user_id = v_pick.user_id AND q.end_user = u.end_user
                      AND (q.not_before IS NULL OR q.not_before <= now())
                      AND (q.queue_expires_at IS NULL OR q.queue_expires_at > now())
                    ORDER BY q.queued_at, q.id LIMIT 1
                ) h
                LEFT JOIN end_user_share e ON e.model_id = p_model_id AND e.priority = v_priority
                                          AND e.user_id = v_pick.user_id AND e.end_user = u.end_user
                WHERE u.end_user IS NOT NULL
                ORDER BY 2, h.queued_at, h.id
            LOOP
                SELECT q.id INTO v_id FROM task q
                WHERE q.status = 'QUEUED' AND q.model_id = p_model_id AND q.priority = v_priority
                  AND q.user_id = v_pick.user_id AND q.end_user = v_eu.end_user
                  AND (q.not_before IS NULL OR q.not_before <= now())
                  AND (q.queue_expires_at IS NULL OR q.queue_expires_at > now())
                  AND NOT q.run_alone
                ORDER BY q.queued_at, q.id LIMIT 1
                FOR UPDATE SKIP LOCKED;
                IF v_id IS NOT NULL THEN
                    INSERT INTO end_user_share AS e (model_id, priority, user_id, end_user, pass)
                    VALUES (p_model_id, v_priority, v_pick.user_id, v_eu.end_user, v_eu.pass + 1.0)
                    ON CONFLICT (model_id, priority, user_id, end_user)
                    DO UPDATE SET pass = GREATEST(e.pass, v_eu_floor) + 1.0;
                    EXIT;
                END IF;
            END LOOP;
            IF v_id IS NOT NULL THEN
                INSERT INTO fair_share AS f (model_id, priority, user_id, pass, end_user_floor)
                VALUES (p_model_id, v_priority, v_pick.user_id, v_pick.pass + 1.0 / v_pick.weight, v_eu.pass)
                ON CONFLICT (model_id, priority, user_id)
                DO UPDATE SET pass = GREATEST(f.pass, v_floor) + 1.0 / v_pick.weight,
                              end_user_floor = GREATEST(f.end_user_floor, v_eu.pass);
                v_new_floor := v_pick.pass;
                EXIT;
            END IF;
        END LOOP;
        IF v_id IS NULL AND claimed.status = 'CREATED' AND (claimed.not_before IS NULL OR claimed.not_before <= now())
           AND (claimed.queue_expires_at IS NULL OR claimed.queue_expires_at > now()) THEN
            v_id := p_task_id;
        END IF;
    END IF;
    IF v_id IS NULL THEN
        IF v_seen THEN
            verdict := 'busy';
            RETURN;
        END IF;
        SELECT EXTRACT(EPOCH FROM min(q.not_before) - now())::float8 INTO wait_seconds FROM task q
        WHERE q.status IN ('CREATED', 'QUEUED') AND q.model_id = p_model_id AND q.priority = v_priority
          AND q.not_before > now();
        verdict := CASE WHEN wait_seconds IS NOT NULL THEN 'early'
                        WHEN claimed.status = 'PROCESSING' THEN 'refused'
                        WHEN claimed.status = 'QUEUED' THEN 'busy'
                        ELSE 'finished' END;
        RETURN;
    END IF;
    UPDATE task t SET status = 'PROCESSING', version = t.version + 1, attempt = t.attempt + 1, worker_id = p_worker_id,
           lease_expires_at = now() + make_interval(secs => p_lease_seconds), started_at = now(), progress = 0,
           worker_losses = t.worker_losses + (t.status = 'PROCESSING' AND NOT v_company)::int,
           company_losses = t.company_losses + (t.status = 'PROCESSING' AND v_company)::int,
           run_alone = t.run_alone OR t.status = 'PROCESSING', alone_for = NULL,
           processed_seconds = t.processed_seconds + CASE WHEN t.status = 'PROCESSING' THEN
               GREATEST(0, EXTRACT(EPOCH FROM LEAST(now(), t.lease_expires_at) - t.started_at))::float8 ELSE 0 END,
           updated_at = now(), last_actor = p_actor, last_reason = p_reason
    FROM (SELECT id, status AS old_status FROM task WHERE id = v_id FOR UPDATE) o
    -- the status compared as text, which no index of task serves, so t is read by primary key: compared as the enum,
    -- statistics taken while nothing was queued walked every queued task in task_end_user_pending_idx (20,009 task
    -- rows for one claim over 20,000 QUEUED, #38 test_id_move_plans)
    WHERE t.id = v_id AND t.id = o.id AND t.status::text IN ('CREATED', 'QUEUED', 'PROCESSING')
      AND (t.status <> 'PROCESSING' OR (t.lease_expires_at < now()
                                        AND (v_company OR p_max_losses IS NULL OR t.worker_losses + 1 < p_max_losses)))
    RETURNING o.old_status INTO old_status;
    verdict := CASE WHEN FOUND THEN 'claimed' ELSE 'refused' END;
    IF verdict = 'claimed' THEN  -- the level moves (the scheduler's QueuedScan reads claimed_at); a fair pick's floor
        INSERT INTO fair_level AS l (model_id, priority, floor, claimed_at)
        VALUES (p_model_id, v_priority, coalesce(v_new_floor, 0), now())
        ON CONFLICT (model_id, priority)
        DO UPDATE SET floor = GREATEST(l.floor, coalesce(v_new_floor, l.floor)), claimed_at = now();
    END IF;
    SELECT t.* INTO claimed FROM task t WHERE t.id = v_id;
    SELECT r.* INTO reusable FROM reusable_result r
    WHERE r.user_id = claimed.user_id AND r.request_hash = claimed.request_hash;
END
$$;
