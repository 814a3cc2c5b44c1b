-- History: the database writes one task_event row per version of a task (and NOTIFYs the event relay), and refuses
-- a version that does not grow by one or a move that task_transition does not list.

CREATE OR REPLACE FUNCTION task_record_event() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'UPDATE' THEN
        IF NEW.version = OLD.version THEN
            RETURN NEW;
        END IF;
        IF NEW.version <> OLD.version + 1 THEN
            RAISE EXCEPTION 'task % version must grow by one (% -> %)', NEW.id, OLD.version, NEW.version;
        END IF;
        IF NOT EXISTS (SELECT 1 FROM task_transition WHERE from_status = OLD.status AND to_status = NEW.status) THEN
            RAISE EXCEPTION 'illegal transition % -> % for task %', OLD.status, NEW.status, NEW.id
                USING ERRCODE = 'check_violation';
        END IF;
    END IF;
    INSERT INTO task_event (task_id, user_id, model_id, version, from_status, to_status, actor, reason, progress,
                            attempt, worker_id, error_code, error_msg, result_uri, result_size, result_sha256,
                            result_content_type)
    VALUES (NEW.id, NEW.user_id, NEW.model_id, NEW.version,
            CASE WHEN TG_OP = 'UPDATE' THEN OLD.status END, NEW.status, NEW.last_actor, NEW.last_reason,
            NEW.progress, NEW.attempt, NEW.worker_id, NEW.error_code, NEW.error_msg, NEW.result_uri,
            NEW.result_size, NEW.result_sha256, NEW.result_content_type);
    PERFORM pg_notify('taskgate_event', NEW.id::text);
    RETURN NEW;
END $$;

CREATE OR REPLACE TRIGGER task_event_on_insert AFTER INSERT ON task FOR EACH ROW EXECUTE FUNCTION task_record_event();
CREATE OR REPLACE TRIGGER task_event_on_update AFTER UPDATE ON task FOR EACH ROW EXECUTE FUNCTION task_record_event();
