-- The inputs of a task's ETA (taskgate/eta.py decides what they come to).

-- name: eta_inputs
-- For each task: its status, version and progress; its queue position (QUEUED only: higher priority first, then
-- older, as submit_queue_position); the median seconds from start to finish of its model's latest successful runs of
-- its size class within the window (task_recent_runs_idx; NULL when none) and how many there were; the capacity of the
-- live, not draining workers that serve its model (QUEUED only); and the database's now. Only QUEUED and PROCESSING
-- tasks read the history. $1 task ids, $2 window seconds, $3 most runs read, $4 seconds a live worker's heartbeat
-- is within.
SELECT t.id, t.status, t.version, t.progress, t.model_id, now() AS now,
       CASE WHEN t.status = 'QUEUED' THEN
           (SELECT count(*) FROM task q WHERE q.status = 'QUEUED' AND q.model_id = t.model_id AND q.priority > t.priority)
         + (SELECT count(*) FROM task q WHERE q.status = 'QUEUED' AND q.model_id = t.model_id AND q.priority = t.priority
              AND (q.queued_at, q.id) < (t.queued_at, t.id))
         + 1
       ELSE 0 END AS queue_position,
       r.run_seconds, r.runs,
       CASE WHEN t.status = 'QUEUED' THEN
           (SELECT floor(coalesce(sum(coalesce(w.capacity, w.slots)), 0))::int FROM worker w
            WHERE t.model_id = ANY(w.models) AND NOT w.draining AND w.last_heartbeat > now() - make_interval(secs => $4))
       ELSE 0 END AS slots
FROM task t
CROSS JOIN LATERAL (
    SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY h.seconds) AS run_seconds, count(*) AS runs
    FROM (SELECT extract(epoch FROM s.finished_at - s.started_at)::float8 AS seconds
          FROM task s
          WHERE t.status IN ('QUEUED', 'PROCESSING')
            AND s.status = 'SUCCEEDED' AND NOT s.result_reused AND s.started_at IS NOT NULL
            AND s.model_id = t.model_id AND s.task_type = t.task_type
            AND task_size_class(s.request_payload) = task_size_class(t.request_payload)
            AND s.finished_at > now() - make_interval(secs => $2)
          ORDER BY s.finished_at DESC
          LIMIT $3) h
) r
WHERE t.id = ANY($1::bigint[]);
