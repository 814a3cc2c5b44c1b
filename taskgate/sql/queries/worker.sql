-- The worker's own queries: its registry row, its claim, reusable outputs.

-- name: worker_upsert
-- Registers a worker or records its heartbeat. $1 id, $2 models, $3 slots, $4 running, $5 device, $6 draining.
INSERT INTO worker (id, models, slots, running, device, draining, started_at, last_heartbeat)
VALUES ($1, $2, $3, $4, $5, $6, now(), now())
ON CONFLICT (id) DO UPDATE SET models = EXCLUDED.models, slots = EXCLUDED.slots, running = EXCLUDED.running,
                               device = EXCLUDED.device, draining = EXCLUDED.draining, last_heartbeat = now();

-- name: worker_delete
-- Removes a worker's registry row on a clean exit. $1 id.
DELETE FROM worker WHERE id = $1;

-- name: worker_cluster_load
-- The cluster's capacity (slots of the workers whose heartbeat is within the lease) and what runs on it (tasks under
-- a live lease, soft-cancelled ones still running included), besides one task being claimed. $1 lease seconds,
-- $2 task id (NULL = none). Counted as the claim counts (task_live_lease_idx).
SELECT (SELECT coalesce(sum(slots), 0) FROM worker WHERE last_heartbeat > now() - make_interval(secs => $1))::int
           AS capacity,
       (SELECT count(*) FROM task
        WHERE task_holds_lease(status, lease_expires_at) AND lease_expires_at > now() AND id IS DISTINCT FROM $2
       )::int AS running;

-- name: worker_claim
-- A worker's claim in one statement (functions/worker_claim.sql): why not, or the new attempt; a reusable output.
-- $1 task id, $2 model id, $3 the model's cap (0 = none), $4 the cluster cap, $5 worker, $6 lease seconds,
-- $7 most lost attempts (NULL = no limit), $8 actor, $9 reason.
SELECT c.verdict, c.old_status, (c.claimed).*, (c.reusable).result_uri AS reusable_uri,
       (c.reusable).result_content_type AS reusable_content_type, (c.reusable).result_size AS reusable_size,
       (c.reusable).result_sha256 AS reusable_sha256
FROM worker_claim($1, $2, $3, $4, $5, $6, $7, $8, $9) c;

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
