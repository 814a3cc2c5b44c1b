-- A lost worker (a lease of its ran out): how many tasks it held when its first lost lease was found, that one
-- included. More than 1: each of its tasks died in company (any of them may have killed it); 1: the task died alone.
-- The first finding records the count on the worker's registry row and every later one (its other tasks' leases run
-- out up to a heartbeat later, found by later scans or takeovers) reads it back: the row lock holds a concurrent
-- finding until the first commits. A heartbeat after the record (a stalled worker that came back, or a new process
-- under the same id) makes the next finding record afresh. A worker with no registry row (forgotten, or a test's) is
-- counted as it stands now.
CREATE OR REPLACE FUNCTION worker_lost_holding(p_worker_id text) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    v_holding integer;
BEGIN
    UPDATE worker w
    SET lost_holding = CASE WHEN w.lost_at IS NULL OR w.lost_at < w.last_heartbeat THEN (
                                SELECT count(*)::int FROM task t
                                WHERE task_holds_lease(t.status, t.lease_expires_at) AND t.worker_id = p_worker_id)
                            ELSE w.lost_holding END,
        lost_at = CASE WHEN w.lost_at IS NULL OR w.lost_at < w.last_heartbeat THEN now() ELSE w.lost_at END
    WHERE w.id = p_worker_id
    RETURNING w.lost_holding INTO v_holding;
    IF NOT FOUND THEN
        SELECT count(*)::int INTO v_holding FROM task t
        WHERE task_holds_lease(t.status, t.lease_expires_at) AND t.worker_id = p_worker_id;
    END IF;
    RETURN GREATEST(v_holding, 1);
END
$$;
