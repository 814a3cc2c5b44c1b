-- ETA: a task's size class (frames x width x height, in powers of two) and an index of each model's recent
-- successful runs per size class, so an estimate reads a few index entries, never the finished tasks.
-- The function is schema (the index calls it): changing it would need a new migration and a REINDEX.
-- A field that is missing or not a number counts as 1, so no payload can make a task's update fail.
CREATE FUNCTION task_size_class(payload jsonb) RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT floor(log(2, greatest(
        CASE WHEN jsonb_typeof(payload -> 'num_frames') = 'number' THEN (payload ->> 'num_frames')::numeric ELSE 1 END
      * CASE WHEN jsonb_typeof(payload -> 'width') = 'number' THEN (payload ->> 'width')::numeric ELSE 1 END
      * CASE WHEN jsonb_typeof(payload -> 'height') = 'number' THEN (payload ->> 'height')::numeric ELSE 1 END,
        1)))::integer
$$;

CREATE INDEX task_recent_runs_idx ON task (model_id, task_size_class(request_payload), finished_at DESC)
    WHERE status = 'SUCCEEDED' AND NOT result_reused AND started_at IS NOT NULL;
