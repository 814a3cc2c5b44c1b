-- History: the database writes one task_event row per version of a task, its id into the relay's outbox
-- (event_outbox), and NOTIFYs the event relay once per statement (and a statement of few events each row, for the
-- WatchTask streams), refuses a version that does not grow by one or a
-- move that task_transition does not list, and keeps each tenant's count of unfinished tasks (tenant_pending; what counts: pending.sql). Statement-level triggers with
-- transition tables: a statement that moves a batch of tasks writes their history in one INSERT, however many rows
-- it touched.

CREATE OR REPLACE FUNCTION task_record_event() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    bad record;
    bad_version bigint;
    bad_move bigint;
    written bigint;
    sent bigint;  -- the small statement's events NOTIFYed (rows_out: a CTE runs only when read)
BEGIN
    IF TG_OP = 'UPDATE' THEN
        -- One join of the statement's old and new rows feeds the history, the pending counts and both checks (it
        -- was one join each: four passes over two tuplestores of whole task rows, most of a batched move's cost).
        -- A check that fails raises below, which undoes this statement's writes with the rest of it.
        WITH pairs AS MATERIALIZED (
            SELECT n.id, n.user_id, n.model_id, n.version, o.version AS old_version, o.status AS old_status, n.status,
                   n.last_actor, n.last_reason, n.progress, n.attempt, n.worker_id, n.error_code, n.error_msg,
                   n.result_uri, n.result_size, n.result_sha256, n.result_content_type, n.end_user,
                   task_holds_pending(n.status, n.lease_expires_at)::int
                       - task_holds_pending(o.status, o.lease_expires_at)::int AS pending_delta
            FROM old_rows o JOIN new_rows n ON n.id = o.id
        ), events AS (
            INSERT INTO task_event (task_id, user_id, model_id, version, from_status, to_status, actor, reason,
                                    progress, attempt, worker_id, error_code, error_msg, result_uri, result_size,
                                    result_sha256, result_content_type, end_user)
            SELECT p.id, p.user_id, p.model_id, p.version, p.old_status, p.status, p.last_actor, p.last_reason,
                   p.progress, p.attempt, p.worker_id, p.error_code, p.error_msg, p.result_uri, p.result_size,
                   p.result_sha256, p.result_content_type, p.end_user
            FROM pairs p
            WHERE p.version = p.old_version + 1  -- every changed version, once the checks below have passed
            ORDER BY p.id
            RETURNING *
        ), relay AS (  -- the relay's outbox: it deletes what it published, the event rows stay as written
            INSERT INTO event_outbox (event_id) SELECT id FROM events
            RETURNING 1
        ), rows_out AS (
            -- A small statement's events, each its row as written, to the notifiers' WatchTask streams when the
            -- transaction commits (services/notifier/committed.py): a NOTIFY is delivered only on commit, in commit
            -- order, and only the database sends it, so no read of the row and no relay pass is on a task's path to
            -- its watchers. A statement of more events sends none (the relay brings them, as it brings every event);
            -- a row too long for a NOTIFY's payload goes as its task and version, and the notifier reads it.
            SELECT pg_notify('taskgate_event_row', CASE WHEN octet_length(r.body) <= 7900 THEN r.body
                             ELSE json_build_object('task_id', e.task_id, 'version', e.version)::text END)
            FROM events e, LATERAL (SELECT row_to_json(e)::text AS body) r
            WHERE (SELECT count(*) FROM events) <= 16
        ), counts AS (
            -- a move out of the unfinished states, or a soft-cancelled run's worker letting go (pending.sql)
            INSERT INTO tenant_pending AS t (tenant_id, pending)
            SELECT p.user_id, sum(p.pending_delta) FROM pairs p WHERE p.pending_delta <> 0
            GROUP BY p.user_id ORDER BY p.user_id  -- counters locked in one order by every statement: no deadlock
            ON CONFLICT (tenant_id) DO UPDATE SET pending = t.pending + EXCLUDED.pending
            RETURNING 1
        )
        SELECT (SELECT count(*) FROM relay), (SELECT count(*) FROM rows_out),
               (SELECT p.id FROM pairs p WHERE p.version <> p.old_version AND p.version <> p.old_version + 1 LIMIT 1),
               (SELECT p.id FROM pairs p
                WHERE p.version = p.old_version + 1
                  AND NOT EXISTS (SELECT 1 FROM task_transition tt WHERE tt.from_status = p.old_status AND tt.to_status = p.status)
                LIMIT 1)
        INTO written, sent, bad_version, bad_move;
        IF bad_version IS NOT NULL THEN
            SELECT n.id, o.version AS old_version, n.version AS new_version INTO bad
            FROM old_rows o JOIN new_rows n ON n.id = o.id WHERE n.id = bad_version;
            RAISE EXCEPTION 'task % version must grow by one (% -> %)', bad.id, bad.old_version, bad.new_version;
        END IF;
        IF bad_move IS NOT NULL THEN
            SELECT n.id, o.status AS old_status, n.status AS new_status INTO bad
            FROM old_rows o JOIN new_rows n ON n.id = o.id WHERE n.id = bad_move;
            RAISE EXCEPTION 'illegal transition % -> % for task %', bad.old_status, bad.new_status, bad.id
                USING ERRCODE = 'check_violation';
        END IF;
    ELSIF TG_OP = 'INSERT' THEN
        WITH events AS (
            INSERT INTO task_event (task_id, user_id, model_id, version, from_status, to_status, actor, reason, progress,
                                    attempt, worker_id, error_code, error_msg, result_uri, result_size, result_sha256,
                                    result_content_type, end_user)
            SELECT n.id, n.user_id, n.model_id, n.version, NULL, n.status, n.last_actor, n.last_reason, n.progress,
                   n.attempt, n.worker_id, n.error_code, n.error_msg, n.result_uri, n.result_size, n.result_sha256,
                   n.result_content_type, n.end_user
            FROM new_rows n
            ORDER BY n.id
            RETURNING id
        )
        INSERT INTO event_outbox (event_id) SELECT id FROM events;
        GET DIAGNOSTICS written = ROW_COUNT;
        INSERT INTO tenant_pending AS p (tenant_id, pending)
        SELECT n.user_id, count(*) FROM new_rows n WHERE task_holds_pending(n.status, n.lease_expires_at)
        GROUP BY n.user_id ORDER BY n.user_id
        ON CONFLICT (tenant_id) DO UPDATE SET pending = p.pending + EXCLUDED.pending;
    ELSE  -- DELETE: history goes with the task (ON DELETE CASCADE); only the counts change
        INSERT INTO tenant_pending AS p (tenant_id, pending)
        SELECT o.user_id, -count(*) FROM old_rows o WHERE task_holds_pending(o.status, o.lease_expires_at)
        GROUP BY o.user_id ORDER BY o.user_id
        ON CONFLICT (tenant_id) DO UPDATE SET pending = p.pending + EXCLUDED.pending;
        RETURN NULL;
    END IF;
    IF written > 0 THEN
        PERFORM pg_notify('taskgate_event', written::text);
    END IF;
    RETURN NULL;
END $$;

CREATE OR REPLACE TRIGGER task_event_on_insert AFTER INSERT ON task
    REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION task_record_event();
CREATE OR REPLACE TRIGGER task_event_on_update AFTER UPDATE ON task
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION task_record_event();
CREATE OR REPLACE TRIGGER task_pending_on_delete AFTER DELETE ON task
    REFERENCING OLD TABLE AS old_rows FOR EACH STATEMENT EXECUTE FUNCTION task_record_event();

-- The counts, recounted whenever the triggers that keep them are (re)installed, with task writes blocked meanwhile:
-- they cannot drift across an upgrade or a trigger that was dropped and put back.
LOCK TABLE task IN SHARE ROW EXCLUSIVE MODE;
INSERT INTO tenant_pending AS p (tenant_id, pending)
SELECT coalesce(c.user_id, p0.tenant_id), coalesce(c.n, 0)
FROM (SELECT user_id, count(*) AS n FROM task WHERE task_holds_pending(status, lease_expires_at) GROUP BY user_id) c
FULL JOIN tenant_pending p0 ON p0.tenant_id = c.user_id
ORDER BY 1
ON CONFLICT (tenant_id) DO UPDATE SET pending = EXCLUDED.pending;
