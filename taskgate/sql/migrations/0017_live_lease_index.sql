-- Live leases, counted by the claim's caps from one small index whatever the planner's statistics say.
--
-- A task holds a lease that counts against the caps while it runs, and while a soft-cancelled run still holds its
-- worker. The function is plpgsql on purpose: a LANGUAGE sql one is inlined into status comparisons, which the planner
-- may then answer from task_status_updated_idx — walking every CANCELED row ever kept — when its statistics lag behind
-- a burst of cancellations (it did: a claim took 8 ms with 20,000 cancelled tasks, 30 ms with 100,000). Opaque, it
-- leaves this partial index (or a sequential scan, far dearer) as the only way to answer the count.
CREATE FUNCTION task_holds_lease(p_status task_status, p_lease_expires_at timestamptz) RETURNS boolean
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
BEGIN
    RETURN p_status = 'PROCESSING' OR (p_status = 'CANCELED' AND p_lease_expires_at IS NOT NULL);
END
$$;

CREATE INDEX task_live_lease_idx ON task (lease_expires_at) INCLUDE (model_id)
    WHERE task_holds_lease(status, lease_expires_at);
