-- A worker's claim of the task a dispatch message names, in one statement: the checks, the caps and the guarded
-- claim (the claim_task block of queries/tasks.sql, same SET and guard: change both together). Run as its own
-- transaction. verdict: 'claimed' (claimed is the new attempt, old_status what it left), 'not_found',
-- 'other_model', 'finished', 'capped', or 'refused' (a live lease, or a takeover that would reach p_max_losses);
-- claimed is otherwise the current row, reusable a soft-cancelled run's output for the same request.
-- plpgsql: each statement takes a fresh snapshot, so the model's count after its lock sees every committed claim.
CREATE OR REPLACE FUNCTION worker_claim(
    p_task_id bigint, p_model_id text, p_cap integer, p_cluster_cap boolean, p_worker_id text, p_lease_seconds float8,
    p_max_losses integer, p_actor text, p_reason text,
    OUT verdict text, OUT old_status task_status, OUT claimed task, OUT reusable reusable_result)
LANGUAGE plpgsql AS $$
DECLARE
    v_running bigint;
    v_model_running bigint;
BEGIN
    -- a claim lost in a crash is fenced by its attempt number: no need to wait for the WAL flush
    PERFORM set_config('synchronous_commit', 'off', true);
    SELECT t.* INTO claimed FROM task t WHERE t.id = p_task_id;
    IF NOT FOUND THEN
        verdict := 'not_found';
        RETURN;
    END IF;
    SELECT r.* INTO reusable FROM reusable_result r
    WHERE r.user_id = claimed.user_id AND r.request_hash = claimed.request_hash;
    IF claimed.model_id <> p_model_id THEN
        verdict := 'other_model';
        RETURN;
    END IF;
    IF claimed.status NOT IN ('CREATED', 'QUEUED', 'PROCESSING') THEN
        verdict := 'finished';
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
        WHERE task_holds_lease(l.status, l.lease_expires_at) AND l.lease_expires_at > now() AND l.id <> p_task_id;
        IF (p_cap > 0 AND v_model_running >= p_cap) OR (p_cluster_cap AND v_running >= (
            SELECT floor(coalesce(sum(coalesce(w.capacity, w.slots)), 0)) FROM worker w
            WHERE w.last_heartbeat > now() - make_interval(secs => p_lease_seconds)
        )) THEN
            verdict := 'capped';
            RETURN;
        END IF;
    END IF;
    UPDATE task t SET status = 'PROCESSING', version = t.version + 1, attempt = t.attempt + 1, worker_id = p_worker_id,
           lease_expires_at = now() + make_interval(secs => p_lease_seconds), started_at = now(), progress = 0,
           worker_losses = t.worker_losses + (t.status = 'PROCESSING')::int,
           processed_seconds = t.processed_seconds + CASE WHEN t.status = 'PROCESSING' THEN
               GREATEST(0, EXTRACT(EPOCH FROM LEAST(now(), t.lease_expires_at) - t.started_at))::float8 ELSE 0 END,
           updated_at = now(), last_actor = p_actor, last_reason = p_reason
    FROM (SELECT id, status AS old_status FROM task WHERE id = p_task_id FOR UPDATE) o
    WHERE t.id = p_task_id AND t.id = o.id AND t.status IN ('CREATED', 'QUEUED', 'PROCESSING')
      AND (t.status <> 'PROCESSING' OR (t.lease_expires_at < now() AND (p_max_losses IS NULL OR t.worker_losses + 1 < p_max_losses)))
    RETURNING o.old_status INTO old_status;
    verdict := CASE WHEN FOUND THEN 'claimed' ELSE 'refused' END;
    SELECT t.* INTO claimed FROM task t WHERE t.id = p_task_id;
END
$$;
