-- The worker's own queries: its registry row, the per-model concurrency cap, reusable outputs.

-- name: worker_upsert
-- Registers a worker or records its heartbeat. $1 id, $2 models, $3 slots, $4 running, $5 device, $6 draining.
INSERT INTO worker (id, models, slots, running, device, draining, started_at, last_heartbeat)
VALUES ($1, $2, $3, $4, $5, $6, now(), now())
ON CONFLICT (id) DO UPDATE SET models = EXCLUDED.models, slots = EXCLUDED.slots, running = EXCLUDED.running,
                               device = EXCLUDED.device, draining = EXCLUDED.draining, last_heartbeat = now();

-- name: worker_delete
-- Removes a worker's registry row on a clean exit. $1 id.
DELETE FROM worker WHERE id = $1;

-- name: worker_lock_model
-- Serialises claims of one model across all workers until the transaction ends. $1 model id.
SELECT pg_advisory_xact_lock(hashtextextended('taskgate.model:' || $1::text, 0));

-- name: worker_count_running
-- Tasks of a model running under a live lease (soft-cancelled ones still running included), besides the one being
-- claimed. $1 model id, $2 task id.
SELECT count(*) FROM task
WHERE model_id = $1 AND status IN ('PROCESSING', 'CANCELED') AND lease_expires_at > now() AND id <> $2;

-- name: worker_preview
-- What a worker checks before claiming: the task's model and state, and a reusable output for the same request
-- (a soft-cancelled run's) if any. $1 task id.
SELECT t.model_id, t.status, r.result_uri, r.result_content_type, r.result_size, r.result_sha256
FROM task t LEFT JOIN reusable_result r ON r.user_id = t.user_id AND r.request_hash = t.request_hash
WHERE t.id = $1;

-- name: worker_keep_reusable
-- Keeps a finished run's output when its attempt was soft-cancelled; no row when the guard or the key says no.
-- $1 task id, $2 attempt, $3 uri, $4 content type, $5 size, $6 sha256.
INSERT INTO reusable_result (user_id, request_hash, source_task_id, result_uri, result_content_type, result_size,
                             result_sha256)
SELECT t.user_id, t.request_hash, t.id, $3, $4, $5, $6
FROM task t
WHERE t.id = $1 AND t.attempt = $2 AND t.status = 'CANCELED' AND t.cancel_mode = 'soft'
ON CONFLICT (user_id, request_hash) DO NOTHING
RETURNING source_task_id;
