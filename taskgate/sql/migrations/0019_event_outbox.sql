-- The event log is append-only for the relay: the events still to relay are an outbox of their ids (written by the
-- history trigger beside each event, deleted by the relay pass that published it), and each pass appends one row
-- saying when it ran and which ids it spanned, instead of rewriting every event row it published (published_at).
-- A WatchTasks stream resuming from a cursor finds the cursor's pass, and so the events that may have reached no
-- subscriber yet, from those rows (queries/notifier.sql).
CREATE TABLE event_outbox (
    event_id bigint PRIMARY KEY REFERENCES task_event (id) ON DELETE CASCADE
);

CREATE TABLE relay_pass (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at          timestamptz NOT NULL,  -- the pass's relay time
    first_event bigint NOT NULL,       -- the smallest and largest event id it published
    last_event  bigint NOT NULL
);
CREATE INDEX relay_pass_at_idx ON relay_pass (at);
CREATE INDEX relay_pass_last_event_idx ON relay_pass (last_event);

-- what was relayed before, as the passes that relayed it; what was not, in the outbox
INSERT INTO relay_pass (at, first_event, last_event)
SELECT published_at, min(id), max(id) FROM task_event WHERE published_at IS NOT NULL GROUP BY published_at ORDER BY 1;
INSERT INTO event_outbox (event_id) SELECT id FROM task_event WHERE published_at IS NULL;

DROP INDEX IF EXISTS task_event_unpublished_idx;
DROP INDEX IF EXISTS task_event_user_published_idx;
COMMENT ON COLUMN task_event.published_at IS 'unused since migration 0019 (event_outbox, relay_pass)';
