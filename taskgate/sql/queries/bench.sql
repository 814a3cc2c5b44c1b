-- `make bench` only: the raw-ceiling handler's statements, closing a phase's leftovers, and bulk history.

-- name: bench_ceiling_insert
-- The least a durable submit writes: one CREATED row (the history trigger adds its event).
INSERT INTO task (id, user_id, idempotency_key, request_hash, task_type, model_id, prompt, request_payload,
                  priority, queue_name)
VALUES (@task_id, @user_id, @idempotency_key, @idempotency_key, 'text-to-video', @model_id, @prompt, '{}', 5, @queue_name);

-- name: bench_ceiling_queue
-- CREATED -> QUEUED once the message is on JetStream, without the guarded transition's extras. $1 id.
UPDATE task SET status = 'QUEUED', version = version + 1, queued_at = now(), updated_at = now(), last_actor = 'bench'
WHERE id = $1 AND status = 'CREATED';

-- name: bench_close_open
-- Ends a phase: every unfinished task is cancelled (one event each), so later phases start with idle queues.
UPDATE task SET status = 'CANCELED', version = version + 1, cancel_mode = 'soft', finished_at = now(), updated_at = now(),
       lease_expires_at = NULL, last_actor = 'bench', last_reason = 'bench phase over'
WHERE status IN ('CREATED', 'QUEUED', 'PROCESSING');

-- name: bench_count_status
-- How many of the tasks $1 (ids) are in each status: a bulk phase checks that every admitted task has its durable row.
SELECT status::text AS status, count(*) AS n FROM task WHERE id = ANY($1::bigint[]) GROUP BY status;

-- name: bench_metered
-- The device seconds metered as counting and as wasted over the tasks $1 (ids): the wasted phase's figures.
SELECT coalesce(sum(device_seconds), 0) AS counted, coalesce(sum(wasted_seconds), 0) AS wasted FROM task WHERE id = ANY($1::bigint[]);

-- name: bench_triggers_off
-- Bulk history rows skip the per-row history trigger and NOTIFY (superuser; this session only).
SET session_replication_role = replica;

-- name: bench_triggers_on
-- Back to normal trigger behaviour for this session.
SET session_replication_role = DEFAULT;

-- name: bench_insert_history
-- $1 finished tasks with ids 1..$1 (far below time-ordered ids), spread over the last 29 days; every tenth
-- belongs to $2, the rest to 97 other tenants. As the scheduler's retention leaves a long-running table: outputs
-- older than $3 seconds (the results retention) already expired, so the measurement is not also a retention backlog.
INSERT INTO task (id, user_id, idempotency_key, idempotency_derived, request_hash, task_type, model_id, prompt,
                  request_payload, metadata, priority, queue_name, status, progress, version, attempt, worker_id,
                  result_uri, result_content_type, result_size, result_sha256, last_actor, last_reason,
                  created_at, updated_at, queued_at, started_at, finished_at, result_expired_at)
SELECT g,
       CASE WHEN g % 10 = 0 THEN $2 ELSE 'hist-' || (g % 97) END,
       'hist-' || g, true, md5(g::text) || md5(g::text), 'text-to-video', 'sleepy', 'historical task ' || g,
       jsonb_build_object('num_frames', 9, 'width', 32, 'height', 32, 'num_inference_steps', 4,
                          'guidance_scale', 5.0, 'fps', 8, 'seed', g, 'negative_prompt', ''),
       '{}', 5, 'taskgate.tasks.sleepy.normal', 'SUCCEEDED', 100, 5, 1, 'hist-worker',
       'nats-os://taskgate-results/' || g || '-a1.json', 'application/json', 100, md5(g::text) || md5(g::text),
       'worker', 'finished',
       t, t + interval '3 s', t + interval '10 ms', t + interval '20 ms', t + interval '3 s',
       CASE WHEN t + interval '3 s' < now() - make_interval(secs => $3) THEN t + make_interval(secs => $3) END
FROM generate_series(1, $1::bigint) AS g,
     LATERAL (SELECT now() - interval '29 days' + (g::float8 / $1 * interval '29 days') AS t) AS times;

-- name: bench_insert_history_events
-- The terminal event of each historical task, already relayed, for the tasks the events retention still keeps
-- them for. $1 the count given to bench_insert_history, $2 the events retention in seconds.
INSERT INTO task_event (task_id, user_id, model_id, version, from_status, to_status, at, actor, reason, progress,
                        attempt, worker_id, result_uri, result_size, result_sha256, result_content_type)
SELECT id, user_id, model_id, 5, 'PROCESSING', 'SUCCEEDED', finished_at, 'worker', 'finished', 100, 1, worker_id,
       result_uri, result_size, result_sha256, result_content_type
FROM task WHERE id <= $1::bigint AND finished_at >= now() - make_interval(secs => $2);

-- name: bench_insert_backlog
-- $1 QUEUED tasks of the tenant $2 with ids $3+1 .. $3+$1 (below time-ordered ids, so ahead of every task
-- submitted later at the same level), queued now (no timeout fires while a phase polls behind them). Inserted with
-- the triggers off: no events, no pending counts; bench_delete_backlog removes them the same way.
INSERT INTO task (id, user_id, idempotency_key, idempotency_derived, request_hash, task_type, model_id, prompt,
                  request_payload, priority, queue_name, status, version, last_actor, created_at, updated_at, queued_at)
SELECT $3::bigint + g, $2, 'backlog-' || g, true, md5(g::text) || md5(g::text), 'text-to-video', 'sleepy',
       'backlog task ' || g,
       jsonb_build_object('num_frames', 9, 'width', 32, 'height', 32, 'num_inference_steps', 4,
                          'guidance_scale', 5.0, 'fps', 8, 'seed', g, 'negative_prompt', ''),
       5, 'taskgate.tasks.sleepy.normal', 'QUEUED', 2, 'bench', now(), now(), now()
FROM generate_series(1, $1::bigint) AS g;

-- name: bench_delete_backlog
-- Removes the tasks bench_insert_backlog made ($1 count, $2 first id - 1), with the triggers off.
DELETE FROM task WHERE id > $2::bigint AND id <= $2::bigint + $1::bigint AND status = 'QUEUED';
