-- Notifier: callback outbox rounds, terminal events without a webhook, and cursor look-ups by relay time.

-- A task with a callback URL whose terminal event asks for no webhook (e.g. a cancel without the CANCELED filter)
-- has callback_status NONE; a task without a URL still always has NONE.
ALTER TABLE task DROP CONSTRAINT task_callback_consistent;
ALTER TABLE task ADD CONSTRAINT task_callback_consistent CHECK (callback_url IS NOT NULL OR callback_status = 'NONE');

-- RedeliverCallback starts a new round of the retry schedule; attempt numbers keep counting across rounds.
ALTER TABLE callback_delivery ADD COLUMN round_start integer NOT NULL DEFAULT 0;

-- WatchTasks resumes by relay time: events relayed at or after the cursor's own relay pass.
CREATE INDEX task_event_user_published_idx ON task_event (user_id, published_at);
