-- The inputs of a task's ETA (taskgate/eta.py decides what they come to).

-- name: eta_inputs
-- For each task: its status, version, progress and priority; the median seconds from start to finish of its model's
-- latest successful runs of its size class within the window (task_recent_runs_idx; NULL when none) and how many
-- there were, and of those runs that generated tokens (chat) the median seconds per output token and the mean output
-- tokens; a chat task's max_output_tokens (NULL for other task types); the database's now. QUEUED tasks also get their place under the real dispatch order: level_position,
-- the claims its (model, priority) level makes up to and including it under fair share (its tenant's turns up to it,
-- counted the same way over the tenant's end users, plus each other tenant's due tasks whose stride pass comes first:
-- functions/worker_claim.sql);
-- queued_high/normal/low, the due QUEUED tasks of each of its model's levels (the weighted pick shares the model's
-- slots among them); and slots, the live, not draining workers' slots that serve its model, each worker's slots
-- shared among its models by the weights of their levels with QUEUED tasks. Only QUEUED and PROCESSING tasks read
-- the history. @window_seconds and @max_runs the history read, @alive_seconds how recent a live worker's heartbeat
-- is, @weights the priority weights (HIGH, NORMAL, LOW).
WITH levels AS MATERIALIZED (
    SELECT q.model_id, q.priority, count(*) AS n,
           CASE q.priority WHEN 10 THEN (@weights::int[])[1] WHEN 5 THEN (@weights::int[])[2] ELSE (@weights::int[])[3] END AS weight
    FROM task q
    WHERE q.status = 'QUEUED' AND (q.not_before IS NULL OR q.not_before <= now())
      AND EXISTS (SELECT 1 FROM task a WHERE a.id = ANY(@task_ids::bigint[]) AND a.status = 'QUEUED')
    GROUP BY q.model_id, q.priority
), serving AS MATERIALIZED (
    SELECT w.models, w.slots::float8 AS slots,
           (SELECT coalesce(sum(l.weight), 0) FROM levels l WHERE l.model_id = ANY(w.models)) AS weights
    FROM worker w
    WHERE NOT w.draining AND w.last_heartbeat > now() - make_interval(secs => @alive_seconds)
)
SELECT t.id, t.status, t.version, t.progress, t.model_id, t.priority, now() AS now,
       CASE WHEN t.task_type = 'chat' THEN (t.request_payload ->> 'max_output_tokens')::bigint END AS max_output_tokens,
       r.token_seconds, r.mean_output_tokens,
       CASE WHEN t.status = 'QUEUED' THEN f.position ELSE 0 END AS level_position,
       coalesce((SELECT l.n FROM levels l WHERE l.model_id = t.model_id AND l.priority = 10), 0) AS queued_high,
       coalesce((SELECT l.n FROM levels l WHERE l.model_id = t.model_id AND l.priority = 5), 0) AS queued_normal,
       coalesce((SELECT l.n FROM levels l WHERE l.model_id = t.model_id AND l.priority = 1), 0) AS queued_low,
       r.run_seconds, r.runs,
       CASE WHEN t.status = 'QUEUED' THEN
           (SELECT coalesce(sum(s.slots * (SELECT coalesce(sum(l.weight), 0) FROM levels l WHERE l.model_id = t.model_id)
                                / nullif(s.weights, 0)), 0)
            FROM serving s WHERE t.model_id = ANY(s.models))
       ELSE 0 END AS slots
FROM task t
CROSS JOIN LATERAL (
    SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY h.seconds) AS run_seconds, count(*) AS runs,
           percentile_cont(0.5) WITHIN GROUP (ORDER BY h.seconds / h.tokens) FILTER (WHERE h.tokens > 0) AS token_seconds,
           avg(h.tokens) FILTER (WHERE h.tokens > 0)::float8 AS mean_output_tokens
    FROM (SELECT extract(epoch FROM s.finished_at - s.started_at)::float8 AS seconds, s.output_tokens AS tokens
          FROM task s
          WHERE t.status IN ('QUEUED', 'PROCESSING')
            AND s.status = 'SUCCEEDED' AND NOT s.result_reused AND s.started_at IS NOT NULL
            AND s.model_id = t.model_id AND s.task_type = t.task_type
            AND task_size_class(s.request_payload) = task_size_class(t.request_payload)
            AND s.finished_at > now() - make_interval(secs => @window_seconds)
          ORDER BY s.finished_at DESC
          LIMIT @max_runs) h
) r
LEFT JOIN LATERAL (
    -- its tenant's k-th turn comes at pass p + (k - 1) / w; another tenant's j-th at q + (j - 1) / v (passes from
    -- the level's floor at least): each other tenant's turns up to there, at most its due tasks, come first
    WITH lv AS (SELECT coalesce((SELECT x.floor FROM fair_level x
                                 WHERE x.model_id = t.model_id AND x.priority = t.priority), 0) AS floor),
    tenants AS (
        SELECT q.user_id, count(*) AS n,
               count(*) FILTER (WHERE (q.queued_at, q.id) <= (t.queued_at, t.id)) AS upto,
               GREATEST(coalesce(fs.pass, lv.floor), lv.floor) AS pass, coalesce(tn.share_weight, 1) AS weight
        FROM task q
        CROSS JOIN lv
        LEFT JOIN fair_share fs ON fs.model_id = q.model_id AND fs.priority = q.priority AND fs.user_id = q.user_id
        LEFT JOIN tenant tn ON tn.id = q.user_id
        WHERE q.status = 'QUEUED' AND q.model_id = t.model_id AND q.priority = t.priority
          AND (q.not_before IS NULL OR q.not_before <= now() OR q.id = t.id)
        GROUP BY q.user_id, fs.pass, lv.floor, tn.share_weight
    ), users AS (  -- inside its tenant's turns, the same count over the tenant's end users (stride 1 each)
        SELECT q.end_user, count(*) AS n,
               count(*) FILTER (WHERE (q.queued_at, q.id) <= (t.queued_at, t.id)) AS upto,
               GREATEST(coalesce(es.pass, uf.floor), uf.floor) AS pass
        FROM task q
        CROSS JOIN (SELECT coalesce((SELECT x.end_user_floor FROM fair_share x
                                     WHERE x.model_id = t.model_id AND x.priority = t.priority
                                       AND x.user_id = t.user_id), 0) AS floor) uf
        LEFT JOIN end_user_share es ON es.model_id = q.model_id AND es.priority = q.priority AND es.user_id = q.user_id
                                   AND es.end_user = q.end_user
        WHERE q.status = 'QUEUED' AND q.model_id = t.model_id AND q.priority = t.priority AND q.user_id = t.user_id
          AND (q.not_before IS NULL OR q.not_before <= now() OR q.id = t.id)
        GROUP BY q.end_user, es.pass, uf.floor
    ), own AS (  -- the tenant's turns up to it: its end user's tasks up to it, and the others' turns that come first
        SELECT u.upto + coalesce((
                   SELECT sum(LEAST(o.n, GREATEST(0, floor(u.pass + u.upto - 1 - o.pass) + 1)))
                   FROM users o WHERE o.end_user <> t.end_user), 0) AS upto
        FROM users u WHERE u.end_user = t.end_user
    ), mine AS (SELECT m.pass + (own.upto - 1) / m.weight AS turn, own.upto FROM tenants m CROSS JOIN own
                WHERE m.user_id = t.user_id)
    SELECT mine.upto + coalesce((
               SELECT sum(LEAST(o.n, GREATEST(0, floor((mine.turn - o.pass) * o.weight) + 1)))
               FROM tenants o WHERE o.user_id <> t.user_id), 0) AS position
    FROM mine
) f ON t.status = 'QUEUED'
WHERE t.id = ANY(@task_ids::bigint[]);

-- name: queue_snapshot_levels
-- The queue that every poll of a process shares (taskgate/queueview.py), read once per refresh, never per poll: one
-- row per (model, priority, tenant) with due QUEUED tasks or a fair-share pass: the tenant's pass (NULL: none yet),
-- its level's floor (NULL: none yet), its share weight, and its due tasks' keys in claim order (queued_at as epoch
-- microseconds, id: the order worker_claim serves each end user of a tenant in) with each one's end user, and the
-- tenant's end users' passes and floor (inside a tenant's turns its end users take turns: #35).
WITH due AS (
    SELECT q.model_id, q.priority, q.user_id,
           array_agg((extract(epoch FROM q.queued_at) * 1000000)::bigint ORDER BY q.queued_at, q.id) AS at,
           array_agg(q.id ORDER BY q.queued_at, q.id) AS ids,
           array_agg(q.end_user ORDER BY q.queued_at, q.id) AS end_users
    FROM task q
    WHERE q.status = 'QUEUED' AND (q.not_before IS NULL OR q.not_before <= now())
    GROUP BY q.model_id, q.priority, q.user_id
), keyed AS (
    SELECT coalesce(d.model_id, fs.model_id) AS model_id, coalesce(d.priority, fs.priority) AS priority,
           coalesce(d.user_id, fs.user_id) AS user_id, fs.pass, d.at, d.ids, d.end_users, fs.end_user_floor
    FROM due d
    FULL JOIN fair_share fs ON fs.model_id = d.model_id AND fs.priority = d.priority AND fs.user_id = d.user_id
)
SELECT k.model_id, k.priority, k.user_id, k.pass, l.floor, coalesce(tn.share_weight, 1) AS weight,
       coalesce(k.at, '{}') AS at, coalesce(k.ids, '{}') AS ids, coalesce(k.end_users, '{}') AS end_users,
       coalesce(k.end_user_floor, 0) AS end_user_floor,
       (SELECT coalesce(jsonb_object_agg(e.end_user, e.pass), '{}') FROM end_user_share e
        WHERE e.model_id = k.model_id AND e.priority = k.priority AND e.user_id = k.user_id) AS end_user_passes
FROM keyed k
LEFT JOIN fair_level l ON l.model_id = k.model_id AND l.priority = k.priority
LEFT JOIN tenant tn ON tn.id = k.user_id;

-- name: queue_snapshot_workers
-- The database's now and the live, not draining workers (their models and slots) of a queue snapshot. $1 seconds a
-- live worker's heartbeat is within.
SELECT now() AS now,
       coalesce((SELECT jsonb_agg(jsonb_build_object('models', w.models, 'slots', w.slots))
                 FROM worker w
                 WHERE NOT w.draining AND w.last_heartbeat > now() - make_interval(secs => $1)), '[]'::jsonb) AS workers;

-- name: eta_run_history
-- The median seconds from start to finish of a model's latest successful runs of one task type and size class within
-- the window (task_recent_runs_idx; NULL when none) and how many there were; of those that generated tokens (chat),
-- the median seconds per output token and the mean output tokens. @size_class as task_size_class gives it,
-- @max_runs the most runs read.
SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY h.seconds) AS run_seconds, count(*) AS runs,
       percentile_cont(0.5) WITHIN GROUP (ORDER BY h.seconds / h.tokens) FILTER (WHERE h.tokens > 0) AS token_seconds,
       avg(h.tokens) FILTER (WHERE h.tokens > 0)::float8 AS mean_output_tokens
FROM (SELECT extract(epoch FROM s.finished_at - s.started_at)::float8 AS seconds, s.output_tokens AS tokens
      FROM task s
      WHERE s.status = 'SUCCEEDED' AND NOT s.result_reused AND s.started_at IS NOT NULL
        AND s.model_id = @model_id AND s.task_type = @task_type AND task_size_class(s.request_payload) = @size_class
        AND s.finished_at > now() - make_interval(secs => @window_seconds)
      ORDER BY s.finished_at DESC
      LIMIT @max_runs) h;
