-- Admission written once (#35): submit_tasks takes the batch as one array of rows with named fields (a JSON array of
-- objects, each read as an admission_item; procrastinate's array of jobs, river's named parameters), not a
-- positional parameter per column. A new field of a submission is one attribute here and one key in
-- taskgate/store/submissions.py. callback_events stays comma-joined, as insert_tasks takes it.
CREATE TYPE admission_item AS (
    id                  bigint,
    user_id             text,
    end_user            text,
    idempotency_key     text,
    idempotency_derived boolean,
    request_hash        text,
    task_type           text,
    model_id            text,
    prompt              text,
    request_payload     jsonb,
    metadata            jsonb,
    priority            smallint,
    queue_name          text,
    max_retries         integer,
    callback_url        text,
    callback_events     text,
    trace_context       jsonb,
    start_after         timestamptz,
    max_queue_seconds   float8,
    per_minute          integer,   -- the tenant's submissions per minute; NULL: its rate slot is already taken
    gpu_estimate        float8     -- its model's GPU-seconds when the run history has none
);

DROP FUNCTION IF EXISTS submit_tasks(bigint[], text[], text[], boolean[], text[], text[], text[], text[], jsonb[], jsonb[],
                                     smallint[], text[], integer[], text[], text[], jsonb[], timestamptz[], float8[],
                                     integer[], integer, float8[], float8, integer, timestamptz, text[], integer, integer);
