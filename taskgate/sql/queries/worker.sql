-- The worker's own queries: its registry row, its claim, reusable outputs.

-- name: worker_beat
-- A worker's heartbeat, one statement however many attempts it runs: renews the lease of each attempt named (as long
-- as it still holds its task: PROCESSING, or CANCELED by a soft cancel that kept the lease), writes the new progress
-- of those given one (the progress_task move, PROCESSING only: a new version, recorded per row by the history
-- trigger), and registers the worker or records its heartbeat when @worker_id is set (NULL: no registry write).
-- Returns, for each renewed attempt, what its move's log line names (not the whole row: a beat renews every running
-- attempt, and decoding 100 whole rows every beat was most of a fleet worker's beat) and whether its progress was
-- written; an attempt absent from the answer no longer holds its task. @task_ids, @attempts and @progress one element per attempt (progress NULL = renew only);
-- @control_address its WorkerControl address (NULL: not known yet, the one recorded stays); @capacity its share of
-- the cluster cap.
WITH registered AS (
    INSERT INTO worker (id, models, slots, running, device, draining, started_at, last_heartbeat, control_address,
                        devices, capacity)
    SELECT @worker_id::text, @models::text[], @slots::int, @running::int, @device::text, @draining::boolean, now(),
           now(), @control_address::text, @devices::int, @capacity::float8
    WHERE @worker_id::text IS NOT NULL
    ON CONFLICT (id) DO UPDATE SET models = EXCLUDED.models, slots = EXCLUDED.slots, running = EXCLUDED.running,
                                   device = EXCLUDED.device, draining = EXCLUDED.draining, last_heartbeat = now(),
                                   control_address = COALESCE(EXCLUDED.control_address, worker.control_address),
                                   devices = EXCLUDED.devices, capacity = EXCLUDED.capacity
), held AS MATERIALIZED (
    -- locked in id order: two beats naming the same tasks (one of them taken over meanwhile) never deadlock
    SELECT h.id, b.attempt, b.progress, (b.progress IS NOT NULL AND h.status = 'PROCESSING') AS moves
    FROM (SELECT id, status FROM task WHERE id = ANY(@task_ids::bigint[]) ORDER BY id FOR UPDATE) h
    JOIN unnest(@task_ids::bigint[], @attempts::int[], @progress::int[]) AS b(id, attempt, progress) ON b.id = h.id
)
UPDATE task t SET lease_expires_at = now() + make_interval(secs => @lease_seconds::float8),
       version = t.version + h.moves::int,
       progress = CASE WHEN h.moves THEN h.progress ELSE t.progress END,
       updated_at = CASE WHEN h.moves THEN now() ELSE t.updated_at END,
       last_actor = CASE WHEN h.moves THEN @actor::text ELSE t.last_actor END,
       last_reason = CASE WHEN h.moves THEN 'progress' ELSE t.last_reason END
FROM held h
WHERE t.id = ANY(@task_ids::bigint[]) AND t.id = h.id AND t.attempt = h.attempt
  -- the status compared as text, which no index of task serves, so task is read by primary key: compared as the
  -- enum, statistics taken while nothing was queued or running planned the beat as a walk of every queued task in
  -- task_end_user_pending_idx (50,000 rows a beat, test_beat_plan; the queue move's trap, 92863d7)
  AND (t.status::text = 'PROCESSING' OR (t.status::text = 'CANCELED' AND t.lease_expires_at IS NOT NULL))
RETURNING t.id, t.version, t.attempt, t.worker_id, h.moves AS progressed;

-- name: worker_delete
-- Removes a worker's registry row on a clean exit. $1 id.
DELETE FROM worker WHERE id = $1;

-- name: worker_cluster_load
-- The cluster's capacity (floor of the summed capacities of the workers whose heartbeat is within the lease) and what
-- runs on it (tasks under a live lease, soft-cancelled ones still running included), besides one task being claimed.
-- $1 lease seconds, $2 task id (NULL = none). Counted as the claim counts (task_live_lease_idx).
SELECT (SELECT floor(coalesce(sum(coalesce(capacity, slots)), 0)) FROM worker
        WHERE last_heartbeat > now() - make_interval(secs => $1))::int AS capacity,
       (SELECT count(*) FROM task
        WHERE task_holds_lease(status, lease_expires_at) AND lease_expires_at > now() AND id IS DISTINCT FROM $2
       )::int AS running;

-- name: worker_claim
-- A worker's claim for one message in one statement (functions/worker_claim.sql): why not, or the new attempt (the
-- fairest due task of the message's level); a reusable output; how long until the level's first task is due.
-- @cap the model's cap (0 = none), @cluster_cap the cluster's, @max_worker_losses most lost attempts (NULL = no limit).
SELECT c.verdict, c.old_status, (c.claimed).*, (c.reusable).result_uri AS reusable_uri,
       (c.reusable).result_content_type AS reusable_content_type, (c.reusable).result_size AS reusable_size,
       (c.reusable).result_sha256 AS reusable_sha256, c.wait_seconds
FROM worker_claim(@task_id, @model_id, @cap, @cluster_cap, @worker_id, @lease_seconds, @max_worker_losses, @actor, @reason) c;

-- name: worker_keep_reusable
-- Keeps a finished run's output when its attempt was soft-cancelled; no row when the guard or the key says no.
INSERT INTO reusable_result (user_id, request_hash, source_task_id, result_uri, result_content_type, result_size,
                             result_sha256)
SELECT t.user_id, t.request_hash, t.id, @uri, @content_type, @size, @sha256
FROM task t
WHERE t.id = @task_id AND t.attempt = @attempt AND t.status::text = 'CANCELED' AND t.cancel_mode = 'soft'
ON CONFLICT (user_id, request_hash) DO NOTHING
RETURNING source_task_id;

-- name: worker_checkpoint_intent
-- Names a running attempt's next checkpoint object before it is stored (listed as garbage until recorded), so no
-- object is ever stored that no row names; no row when the attempt no longer runs the task (then store nothing).
-- $1 task id, $2 attempt, $3 uri.
UPDATE task SET checkpoint_garbage = array_append(checkpoint_garbage, $3)
WHERE id = $1 AND attempt = $2 AND status::text = 'PROCESSING' AND lease_expires_at IS NOT NULL
RETURNING id;

-- name: worker_preview_intent
-- Names a running attempt's next preview image before it is stored (retention deletes it with the task's output); no
-- row when the attempt no longer runs the task (then store nothing). $1 task id, $2 attempt, $3 uri.
UPDATE task SET preview_uris = array_append(preview_uris, $3)
WHERE id = $1 AND attempt = $2 AND status::text = 'PROCESSING' AND lease_expires_at IS NOT NULL
RETURNING id;

-- name: worker_checkpoint
-- Records a running attempt's newest checkpoint (stored since its intent); the one it replaces joins the garbage, and
-- the objects the caller deleted since its last record leave it; returns the garbage to delete now. No row when the
-- attempt no longer runs the task. @deleted the uris deleted since.
UPDATE task t SET checkpoint_uri = @uri, checkpoint_step = @step,
       checkpoint_garbage = ARRAY(SELECT g FROM unnest(t.checkpoint_garbage) g WHERE g <> @uri AND g <> ALL(@deleted::text[]))
                            || CASE WHEN o.old_uri IS NULL OR o.old_uri = @uri THEN '{}'::text[] ELSE ARRAY[o.old_uri] END
FROM (SELECT id, checkpoint_uri AS old_uri FROM task WHERE id = @task_id FOR UPDATE) o
WHERE t.id = @task_id AND t.id = o.id AND t.attempt = @attempt AND t.status::text = 'PROCESSING'
  AND t.lease_expires_at IS NOT NULL
RETURNING t.checkpoint_garbage;

-- name: worker_drop_checkpoint
-- Forgets an ended task's checkpoints once their objects are deleted. $1 task id.
UPDATE task SET checkpoint_uri = NULL, checkpoint_garbage = '{}'
WHERE id = $1 AND finished_at IS NOT NULL
RETURNING id;
