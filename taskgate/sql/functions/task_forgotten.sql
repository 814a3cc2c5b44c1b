-- A deleted task (a purge, retention, SQL by hand) or an expired output is announced on channel taskgate_task_forgotten
-- with the task's id as the payload: each submit replica's terminal-task cache forgets it at once, so a deletion a
-- tenant or a privacy request relies on is not answered from memory (services/submit/cache.py TerminalCache.forget).
CREATE OR REPLACE FUNCTION task_forgotten_notify() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('taskgate_task_forgotten', CASE WHEN TG_OP = 'DELETE' THEN OLD.id ELSE NEW.id END::text);
    RETURN NULL;
END
$$;

CREATE OR REPLACE TRIGGER task_deleted_forgotten AFTER DELETE ON task
    FOR EACH ROW EXECUTE FUNCTION task_forgotten_notify();

CREATE OR REPLACE TRIGGER task_result_expired_forgotten AFTER UPDATE OF result_expired_at ON task
    FOR EACH ROW WHEN (OLD.result_expired_at IS DISTINCT FROM NEW.result_expired_at) EXECUTE FUNCTION task_forgotten_notify();
