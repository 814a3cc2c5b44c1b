-- Files and batches (#36): a tenant's files in the result store (a batch's JSONL input, its output and error lines),
-- and batches that submit each line of an input as one task. A batch's lines are recorded as they are submitted
-- (batch_item: the line's task, or why it was refused) with the ingest's progress in the same statement, so an ingest
-- that died resumes at the first line not recorded; each line's idempotency key (the batch and its custom_id) makes
-- a line submitted again by the resumed ingest answer with the task it already has.
CREATE TABLE stored_file (
    id          bigint PRIMARY KEY,
    user_id     text NOT NULL,
    purpose     text NOT NULL CHECK (purpose IN ('batch', 'batch_output', 'batch_error')),
    filename    text NOT NULL,
    uri         text NOT NULL,
    size_bytes  bigint NOT NULL,
    sha256      text NOT NULL,
    batch_id    bigint,  -- batch_output and batch_error: the batch whose lines it holds
    created_at  timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX stored_file_user_idx ON stored_file (user_id, id DESC);

CREATE TABLE task_batch (
    id                bigint PRIMARY KEY,
    user_id           text NOT NULL,
    end_user          text NOT NULL DEFAULT '',
    input_file_id     bigint NOT NULL REFERENCES stored_file (id),
    endpoint          text NOT NULL,
    completion_window text NOT NULL,
    metadata          jsonb NOT NULL DEFAULT '{}',
    status            text NOT NULL DEFAULT 'validating' CHECK (status IN (
        'validating', 'in_progress', 'finalizing', 'completed', 'failed', 'cancelling', 'cancelled', 'expired')),
    total_lines       integer,  -- known once the input was read
    ingested_lines    integer NOT NULL DEFAULT 0,  -- lines recorded in batch_item: where a resumed ingest starts
    lease_until       timestamptz,  -- whoever ingests or finalizes it holds it until then; lapsed: another may
    output_file_id    bigint,
    error_file_id     bigint,
    error_message     text,
    created_at        timestamptz NOT NULL DEFAULT now(),
    in_progress_at    timestamptz,
    finalizing_at     timestamptz,
    completed_at      timestamptz,
    failed_at         timestamptz,
    cancelling_at     timestamptz,
    cancelled_at      timestamptz,
    expires_at        timestamptz NOT NULL
);
CREATE INDEX task_batch_user_idx ON task_batch (user_id, id DESC);

CREATE TABLE batch_item (
    batch_id   bigint NOT NULL REFERENCES task_batch (id) ON DELETE CASCADE,
    line       integer NOT NULL,  -- 0-based line of the input
    custom_id  text NOT NULL,
    task_id    bigint,  -- NULL: refused (error says why)
    error      jsonb,
    PRIMARY KEY (batch_id, line),
    CHECK ((task_id IS NULL) <> (error IS NULL))
);
CREATE INDEX batch_item_task_idx ON batch_item (task_id);
