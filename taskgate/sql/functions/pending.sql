-- What takes one of a tenant's pending slots (max_pending): an unfinished task, or a soft-cancelled one whose worker
-- still runs it (the cancel keeps its lease until the worker lets go, or the scheduler ends the lapsed lease). The
-- history trigger (task_history.sql) keeps tenant_pending by it. Before task_history.sql in name order: its recount
-- calls it.
CREATE OR REPLACE FUNCTION task_holds_pending(p_status task_status, p_lease_expires_at timestamptz) RETURNS boolean
LANGUAGE sql IMMUTABLE AS $$
    SELECT p_status IN ('CREATED', 'QUEUED', 'PROCESSING') OR (p_status = 'CANCELED' AND p_lease_expires_at IS NOT NULL)
$$;
