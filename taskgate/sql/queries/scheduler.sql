-- The scheduler's scans and the TaskAdmin API. Every scan takes an optional "now" ($1, NULL = now()) so tests can
-- move the clock, and locks what it returns with FOR UPDATE SKIP LOCKED so replicas never take the same row.
-- The moves themselves are the typed ones of taskgate/store/tasks.py (the guarded blocks of tasks.sql).

-- name: sched_created_due
-- CREATED tasks older than the created timeout (their dispatch was lost or never confirmed). $1 now, $2 timeout
-- seconds, $3 limit.
SELECT * FROM task
WHERE status = 'CREATED'
  AND updated_at < COALESCE($1::timestamptz, now()) - make_interval(secs => $2)
ORDER BY updated_at
LIMIT $3
FOR UPDATE SKIP LOCKED;

-- name: sched_queue_expired
-- QUEUED tasks past their own queue TTL (max_queue_seconds: queue_expires_at), soonest first. $1 now, $2 limit.
SELECT * FROM task
WHERE status = 'QUEUED' AND queue_expires_at IS NOT NULL AND queue_expires_at <= COALESCE($1::timestamptz, now())
ORDER BY queue_expires_at
LIMIT $2
FOR UPDATE SKIP LOCKED;

-- name: sched_queued_due
-- QUEUED tasks waiting longer than their model's queue timeout, counted from the last (re-)publish or the end of
-- a retry backoff, at a model whose queue does not move: no claim at the model within the timeout and no task of it
-- running (a backlog that moves is no loss). @models and their timeouts in @seconds, @default_seconds for any other
-- model, @smallest the smallest timeout (the index bound).
SELECT t.* FROM task t
CROSS JOIN LATERAL (
    SELECT COALESCE((SELECT m.secs FROM unnest(@models::text[], @seconds::float8[]) AS m(model_id, secs)
                     WHERE m.model_id = t.model_id), @default_seconds) AS secs
) o
WHERE t.status = 'QUEUED'
  AND t.updated_at < COALESCE(@now::timestamptz, now()) - make_interval(secs => @smallest)
  AND GREATEST(t.updated_at, t.not_before) < COALESCE(@now::timestamptz, now()) - make_interval(secs => o.secs)
  AND NOT EXISTS (SELECT 1 FROM fair_level l
                  WHERE l.model_id = t.model_id AND l.claimed_at > COALESCE(@now::timestamptz, now()) - make_interval(secs => o.secs))
  AND NOT EXISTS (SELECT 1 FROM task r
                  WHERE task_holds_lease(r.status, r.lease_expires_at) AND r.lease_expires_at > COALESCE(@now::timestamptz, now())
                    AND r.model_id = t.model_id)
ORDER BY t.updated_at
LIMIT @limit
FOR UPDATE OF t SKIP LOCKED;

-- name: sched_level_holders
-- Per (model, priority) level: the tasks that hold a dispatch message of the level, QUEUED ones and those holding a
-- lease (a running attempt keeps its message unacknowledged). $1 model ids, $2 priorities (pairwise).
SELECT u.model_id, u.priority,
       (SELECT count(*) FROM task q WHERE q.status = 'QUEUED' AND q.model_id = u.model_id AND q.priority = u.priority)
     + (SELECT count(*) FROM task r
        WHERE task_holds_lease(r.status, r.lease_expires_at) AND r.model_id = u.model_id AND r.priority = u.priority)
       AS holders
FROM unnest($1::text[], $2::smallint[]) AS u(model_id, priority);

-- name: sched_lease_expired
-- PROCESSING tasks whose lease ran out: the worker died or lost its connection. $1 now, $2 limit.
SELECT * FROM task
WHERE status = 'PROCESSING' AND lease_expires_at < COALESCE($1::timestamptz, now())
ORDER BY lease_expires_at
LIMIT $2
FOR UPDATE SKIP LOCKED;

-- name: sched_worker_lost_holding
-- How many tasks a lost worker held when its first lost lease was found (functions/worker_lost.sql). $1 worker id.
SELECT worker_lost_holding($1);

-- name: sched_processing_overdue
-- PROCESSING tasks with a live lease whose processing time, earlier attempts included, ran past their model's
-- processing timeout (plus @grace_seconds once it was granted). @models and their timeouts in @seconds,
-- @default_seconds for any other model.
SELECT t.* FROM task t
WHERE t.status = 'PROCESSING'
  AND t.lease_expires_at >= COALESCE(@now::timestamptz, now())
  AND t.started_at + make_interval(secs => COALESCE(
        (SELECT m.secs FROM unnest(@models::text[], @seconds::float8[]) AS m(model_id, secs) WHERE m.model_id = t.model_id), @default_seconds)
        + CASE WHEN t.timeout_extended THEN @grace_seconds ELSE 0 END - t.processed_seconds) < COALESCE(@now::timestamptz, now())
ORDER BY t.started_at
LIMIT @limit
FOR UPDATE OF t SKIP LOCKED;

-- name: sched_grant_grace
-- The one grace extension of a slow but live attempt; not a transition, so no new version. $1 id, $2 attempt.
UPDATE task SET timeout_extended = true
WHERE id = $1 AND status::text = 'PROCESSING' AND attempt = $2 AND NOT timeout_extended  -- text: by primary key (#38)
RETURNING id;

-- name: sched_dead_letter_missing
-- Dead letters for recent FAILED tasks that exhausted their retries but have none (a writer that failed them
-- without store.fail(dead_letter=True)). $1 now, $2 window seconds, $3 reason, $4 limit.
INSERT INTO dead_letter (task_id, reason, error_code, error_msg)
SELECT t.id, $3, t.error_code, t.error_msg FROM task t
WHERE t.status = 'FAILED'
  AND t.updated_at > COALESCE($1::timestamptz, now()) - make_interval(secs => $2)
  AND t.retry_count >= t.max_retries
  AND NOT EXISTS (SELECT 1 FROM dead_letter d WHERE d.task_id = t.id)
ORDER BY t.updated_at
LIMIT $4
ON CONFLICT (task_id) DO NOTHING
RETURNING task_id;

-- name: sched_lapsed_holds
-- Soft-cancelled attempts whose lease ran out (their worker died or stalled before letting go): the lease ends, and
-- with it the tenant's pending slot. Not a transition: no new version. $1 now, $2 limit.
UPDATE task SET lease_expires_at = NULL
WHERE id IN (SELECT id FROM task
             WHERE status = 'CANCELED' AND lease_expires_at < COALESCE($1::timestamptz, now())
             ORDER BY lease_expires_at
             LIMIT $2
             FOR UPDATE SKIP LOCKED)
RETURNING id;

-- name: sched_forget_workers
-- Deletes registry rows of workers silent for longer than the given time. $1 now, $2 seconds, $3 limit.
DELETE FROM worker w
WHERE w.last_heartbeat < COALESCE($1::timestamptz, now()) - make_interval(secs => $2)
  AND w.id IN (SELECT id FROM worker
               WHERE last_heartbeat < COALESCE($1::timestamptz, now()) - make_interval(secs => $2)
               ORDER BY last_heartbeat LIMIT $3 FOR UPDATE SKIP LOCKED)
RETURNING w.id;

-- name: sched_queue_gauges
-- Per model: QUEUED count, age of the oldest QUEUED task (seconds), PROCESSING count.
SELECT model_id,
       count(*) FILTER (WHERE status = 'QUEUED') AS queued,
       EXTRACT(EPOCH FROM now() - min(queued_at) FILTER (WHERE status = 'QUEUED'))::float8 AS oldest_queued_age,
       count(*) FILTER (WHERE status = 'PROCESSING') AS processing
FROM task
WHERE status IN ('QUEUED', 'PROCESSING')
GROUP BY model_id;

-- name: sched_workers_alive
-- Workers whose heartbeat is within the lease. $1 lease seconds.
SELECT count(*) FROM worker WHERE last_heartbeat > now() - make_interval(secs => $1);

-- name: admin_state_counts
-- Tasks per model and state.
SELECT model_id, status::text AS status, count(*) AS n FROM task GROUP BY model_id, status ORDER BY model_id, status;

-- name: admin_live_counts
-- Unfinished tasks per model and state: the summary after each requeue batch.
SELECT model_id, status::text AS status, count(*) AS n FROM task
WHERE status IN ('CREATED', 'QUEUED', 'PROCESSING')
GROUP BY model_id, status ORDER BY model_id, status;

-- name: admin_live_priority_counts
-- Unfinished tasks per model, priority and state: the queue depth by priority (GetStats' live counts).
SELECT model_id, priority, status::text AS status, count(*) AS n FROM task
WHERE status IN ('CREATED', 'QUEUED', 'PROCESSING')
GROUP BY model_id, priority, status ORDER BY model_id, priority DESC, status;

-- name: admin_oldest_queued_age
-- Seconds since the oldest QUEUED task was queued; NULL when none is.
SELECT EXTRACT(EPOCH FROM now() - min(queued_at))::float8 FROM task WHERE status = 'QUEUED';

-- name: admin_worker_stats
-- Each registered worker and each worker holding PROCESSING tasks: running tasks, slots, heartbeat, alive, device,
-- draining, WorkerControl address, devices and capacity (its slots for a worker that registers none). $1 lease seconds.
SELECT COALESCE(w.id, p.worker_id) AS worker_id, COALESCE(p.n, 0) AS running, COALESCE(w.slots, 0) AS slots,
       w.last_heartbeat, COALESCE(w.last_heartbeat > now() - make_interval(secs => $1), false) AS alive,
       COALESCE(w.device, '') AS device, COALESCE(w.draining, false) AS draining,
       COALESCE(w.control_address, '') AS control_address, COALESCE(w.devices, 0) AS devices,
       COALESCE(w.capacity, w.slots, 0)::float8 AS capacity
FROM worker w
FULL JOIN (SELECT worker_id, count(*) AS n FROM task WHERE status = 'PROCESSING' GROUP BY worker_id) p
       ON p.worker_id = w.id
ORDER BY 1;

-- name: admin_callback_counts
-- Webhook deliveries per outcome.
SELECT status, count(*) AS n FROM callback_delivery GROUP BY status ORDER BY status;

-- name: admin_list_tasks
-- Tasks by state, model and age, least recently updated first, keyset-paged on (updated_at, id).
-- @states empty = all, @model_id NULL = all, @older_than_seconds since updated_at (NULL = any), @after_at and
-- @after_id the last row's updated_at and id (NULL = first page).
SELECT * FROM task
WHERE (cardinality(@states::task_status[]) = 0 OR status = ANY(@states::task_status[]))
  AND (@model_id::text IS NULL OR model_id = @model_id)
  AND (@older_than_seconds::float8 IS NULL OR updated_at < now() - make_interval(secs => @older_than_seconds))
  AND (@after_at::timestamptz IS NULL OR (updated_at, id) > (@after_at, @after_id::bigint))
ORDER BY updated_at, id
LIMIT @limit;

-- name: admin_list_tasks_newest
-- As admin_list_tasks, most recently updated first, keyset-paged on (updated_at, id) descending: one backward
-- descent of task_status_updated_idx per state, so the newest page reads a few index pages however many finished
-- tasks the table keeps. @states distinct, never empty (the store names every state for none); @after_at and
-- @after_id the last row's updated_at and id, the page going back from it.
SELECT t.* FROM unnest(@states::task_status[]) AS s(status)
CROSS JOIN LATERAL (
    SELECT * FROM task
    WHERE status = s.status
      AND (@model_id::text IS NULL OR model_id = @model_id)
      AND (@older_than_seconds::float8 IS NULL OR updated_at < now() - make_interval(secs => @older_than_seconds))
      AND (@after_at::timestamptz IS NULL OR (updated_at <= @after_at AND (updated_at, id) < (@after_at, @after_id::bigint)))
    ORDER BY updated_at DESC, id DESC
    LIMIT @limit
) t
ORDER BY t.updated_at DESC, t.id DESC
LIMIT @limit;

-- name: admin_requeue_page
-- Ids of tasks matching a requeue filter, by id (stable while they are requeued), leaving out tasks already replayed
-- (only a FAILED or TIMEOUT one can be): a replay by filter sent again replays only what is left.
-- @model_id NULL = all, @older_than_seconds the minimum seconds since updated_at (NULL = any).
SELECT t.id FROM task t
WHERE t.status = ANY(@statuses::task_status[])
  AND (@model_id::text IS NULL OR t.model_id = @model_id)
  AND (@older_than_seconds::float8 IS NULL OR t.updated_at < now() - make_interval(secs => @older_than_seconds))
  AND t.id > @after_id
  AND NOT EXISTS (SELECT 1 FROM task r WHERE r.replay_of = t.id)
ORDER BY t.id
LIMIT @limit;

-- name: admin_peek_tasks
-- Tasks by id, without locking, whether each holds a live lease, and the task replaying each (NULL: none). $1 ids.
SELECT t.*, (t.status = 'PROCESSING' AND t.lease_expires_at >= now()) AS lease_live,
       (SELECT r.id FROM task r WHERE r.replay_of = t.id) AS replayed_as
FROM task t WHERE t.id = ANY($1::bigint[]);

-- name: admin_lock_tasks
-- Tasks by id, locked for a requeue or a replay (rows a scan or worker holds are skipped), whether each holds a live
-- lease, and the task replaying each (NULL: none; read after the lock, so a replay committed meanwhile is seen).
-- $1 ids.
SELECT t.*, (t.status = 'PROCESSING' AND t.lease_expires_at >= now()) AS lease_live,
       (SELECT r.id FROM task r WHERE r.replay_of = t.id) AS replayed_as
FROM task t
WHERE t.id = ANY($1::bigint[])
ORDER BY t.id
FOR UPDATE OF t SKIP LOCKED;

-- name: admin_replay_tasks
-- Replays of FAILED or TIMEOUT tasks: new tasks in CREATED, each naming its source, inserted by the one author of
-- task rows (functions/submit_fast_path.sql) without the tenants' rate and pending limits (an operator's act), and
-- each source's dead letter (if it has one) given its replay, in one statement. One array per column as for
-- submit_insert_tasks, @replay_of the source task ids. No row for an item whose idempotency key is taken.
WITH made AS MATERIALIZED (
    SELECT * FROM insert_tasks(
        p_id => @id, p_user_id => @user_id, p_idempotency_key => @idempotency_key,
        p_idempotency_derived => @idempotency_derived, p_request_hash => @request_hash, p_task_type => @task_type,
        p_model_id => @model_id, p_prompt => @prompt, p_request_payload => @request_payload, p_metadata => @metadata,
        p_priority => @priority, p_queue_name => @queue_name, p_max_retries => @max_retries,
        p_callback_url => @callback_url, p_callback_events => @callback_events, p_trace_context => @trace_context,
        p_start_after => @start_after, p_max_queue_seconds => @max_queue_seconds, p_end_user => @end_user,
        p_replay_of => @replay_of)
), linked AS (
    UPDATE dead_letter d SET replayed_as = m.id, replayed_at = now()
    FROM made m WHERE d.task_id = m.replay_of
    RETURNING d.task_id
)
SELECT m.* FROM made m  -- linked runs to completion unread, as every data-modifying WITH does
ORDER BY m.id;

-- name: admin_dead_letters
-- Dead letters with their tasks and their replays (NULL: not replayed), newest first, keyset-paged on (dead_at, task_id). $1 before dead_at,
-- $2 before task id (NULL = first page), $3 limit.
SELECT t.*, d.reason AS dead_reason, d.created_at AS dead_at, d.replayed_as, d.replayed_at
FROM dead_letter d JOIN task t ON t.id = d.task_id
WHERE $1::timestamptz IS NULL OR (d.created_at, d.task_id) < ($1, $2::bigint)
ORDER BY d.created_at DESC, d.task_id DESC
LIMIT $3;

-- name: retention_expired_tasks
-- Finished tasks past their retention, oldest first, locked; the caller deletes them (their events, webhook
-- deliveries, attempt logs and dead letters go with them). Kept whatever their age: a task whose webhook is still owed
-- (its terminal one PENDING, or any delivery PENDING) and a soft-cancelled task whose attempt still holds its lease.
-- $1 now, $2 seconds, $3 limit.
SELECT t.id, t.user_id, t.request_hash, t.result_uri, t.result_expired_at, t.preview_uris FROM task t
WHERE t.finished_at < COALESCE($1::timestamptz, now()) - make_interval(secs => $2)
  AND t.callback_status <> 'PENDING' AND NOT task_holds_lease(t.status, t.lease_expires_at)
  AND NOT EXISTS (SELECT 1 FROM callback_delivery d WHERE d.task_id = t.id AND d.status = 'PENDING')
ORDER BY t.finished_at
LIMIT $3
FOR UPDATE OF t SKIP LOCKED;

-- name: retention_delete_tasks
-- Deletes tasks by id (history, deliveries, attempt logs and dead letters cascade). $1 ids.
DELETE FROM task WHERE id = ANY($1::bigint[]) RETURNING id;

-- name: retention_expire_results
-- Marks the outputs of tasks finished before the retention as deleted, oldest first, skipping locked rows; returns
-- what each output was, for the caller to delete from the store. An output kept in the row (an inline data: URI,
-- taskgate.results.inline) is deleted here, from the row and from its events: the URI keeps its media type and loses
-- its bytes. $1 now, $2 seconds, $3 limit.
WITH expired AS (
    UPDATE task t SET result_expired_at = COALESCE($1::timestamptz, now()),
                      result_uri = CASE WHEN t.result_uri LIKE 'data:%' THEN split_part(t.result_uri, ',', 1) || ','
                                        ELSE t.result_uri END
    WHERE t.id IN (SELECT id FROM task
                   WHERE finished_at < COALESCE($1::timestamptz, now()) - make_interval(secs => $2)
                     AND result_uri IS NOT NULL AND result_expired_at IS NULL
                   ORDER BY finished_at
                   LIMIT $3
                   FOR UPDATE SKIP LOCKED)
    RETURNING t.id, t.user_id, t.request_hash, t.result_uri
), events AS (
    UPDATE task_event e SET result_uri = split_part(e.result_uri, ',', 1) || ','
    FROM expired x
    WHERE e.task_id = x.id AND e.result_uri LIKE 'data:%'
    RETURNING 1
)
SELECT x.user_id, x.request_hash, x.result_uri FROM expired x;

-- name: retention_expire_previews
-- Forgets the preview images of tasks finished before the retention, oldest first, skipping locked rows; returns them
-- for the caller to delete inside the same transaction (a preview belongs to one task: nothing else refers to it).
-- $1 now, $2 seconds, $3 limit.
UPDATE task t SET preview_uris = '{}'
FROM (SELECT id, preview_uris AS uris FROM task
      WHERE finished_at < COALESCE($1::timestamptz, now()) - make_interval(secs => $2) AND preview_uris <> '{}'
      ORDER BY finished_at
      LIMIT $3
      FOR UPDATE SKIP LOCKED) o
WHERE t.id = o.id
RETURNING o.uris;

-- name: retention_delete_events
-- Deletes relayed history rows older than the retention of tasks finished before it (their webhook deliveries and
-- attempt logs cascade; an event whose delivery is still PENDING stays), oldest first, skipping locked rows, and the
-- relay's pass records of the same age. $1 now, $2 seconds, $3 limit.
WITH passes AS (
    DELETE FROM relay_pass WHERE at < COALESCE($1::timestamptz, now()) - make_interval(secs => $2)
)
DELETE FROM task_event e
WHERE e.id IN (SELECT x.id FROM task_event x JOIN task t ON t.id = x.task_id
               WHERE x.at < COALESCE($1::timestamptz, now()) - make_interval(secs => $2)
                 AND NOT EXISTS (SELECT 1 FROM event_outbox o WHERE o.event_id = x.id)
                 AND NOT EXISTS (SELECT 1 FROM callback_delivery d
                                 WHERE d.task_id = x.task_id AND d.event_id = x.id AND d.status = 'PENDING')
                 AND t.finished_at < COALESCE($1::timestamptz, now()) - make_interval(secs => $2)
               ORDER BY x.at
               LIMIT $3
               FOR UPDATE OF x SKIP LOCKED)
RETURNING e.id;

-- name: retention_delete_reusable
-- Deletes reusable outputs kept longer than the retention, oldest first, skipping locked rows; returns what each
-- was. $1 now, $2 seconds, $3 limit.
DELETE FROM reusable_result r
WHERE (r.user_id, r.request_hash) IN (SELECT user_id, request_hash FROM reusable_result
                                      WHERE created_at < COALESCE($1::timestamptz, now()) - make_interval(secs => $2)
                                      ORDER BY created_at
                                      LIMIT $3
                                      FOR UPDATE SKIP LOCKED)
RETURNING r.user_id, r.request_hash, r.result_uri;

-- name: retention_delete_inputs
-- Deletes input images last used before the cut-off that no task of their tenant (kept, any status) refers to,
-- oldest first, skipping locked rows; returns what each was. $1 now, $2 seconds, $3 limit.
DELETE FROM task_input i
WHERE (i.user_id, i.sha256) IN (SELECT c.user_id, c.sha256 FROM task_input c
                                WHERE c.last_used_at < COALESCE($1::timestamptz, now()) - make_interval(secs => $2)
                                  AND NOT EXISTS (SELECT 1 FROM task t
                                                  WHERE t.user_id = c.user_id AND t.request_payload ? 'image'
                                                    AND t.request_payload -> 'image' ->> 'sha256' = c.sha256)
                                ORDER BY c.last_used_at
                                LIMIT $3
                                FOR UPDATE SKIP LOCKED)
RETURNING i.sha256, i.uri;

-- name: retention_unreferenced_inputs
-- Of the given input objects, those no tenant's row refers to any more, each taken under its input's advisory lock
-- (submit_keep_input takes it too) until the caller's transaction ends, so the object is deleted before a new row
-- for it can commit. $1 sha256s, $2 uris.
SELECT u.uri FROM (SELECT DISTINCT * FROM unnest($1::text[], $2::text[]) AS u(sha256, uri) ORDER BY sha256) u,
     LATERAL (SELECT pg_advisory_xact_lock(hashtextextended('taskgate.input:' || u.sha256, 0))) lock
WHERE NOT EXISTS (SELECT 1 FROM task_input i WHERE i.sha256 = u.sha256);

-- name: retention_unreferenced
-- Of the given outputs, those that no task (with its output still kept) and no reusable output refers to any more:
-- an output can be shared by the tasks of one tenant's identical requests. $1 user ids, $2 request hashes, $3 uris.
SELECT DISTINCT u.uri FROM unnest($1::text[], $2::text[], $3::text[]) AS u(user_id, request_hash, uri)
WHERE NOT EXISTS (SELECT 1 FROM task t
                  WHERE t.user_id = u.user_id AND t.request_hash = u.request_hash AND t.result_sha256 IS NOT NULL
                    AND t.result_uri = u.uri AND t.result_expired_at IS NULL)
  AND NOT EXISTS (SELECT 1 FROM reusable_result r
                  WHERE r.user_id = u.user_id AND r.request_hash = u.request_hash AND r.result_uri = u.uri);

-- name: retention_counts
-- What a purge at this cut-off would delete (finished tasks, their kept outputs, reusable outputs) and the finished
-- tasks past it that it keeps, by reason: a webhook still owed, a soft-cancelled attempt still running (both count
-- as the former). $1 now, $2 seconds.
WITH old AS (
    SELECT t.result_uri, t.result_expired_at,
           (t.callback_status = 'PENDING'
            OR EXISTS (SELECT 1 FROM callback_delivery d WHERE d.task_id = t.id AND d.status = 'PENDING')) AS owed,
           task_holds_lease(t.status, t.lease_expires_at) AS running
    FROM task t
    WHERE t.finished_at < COALESCE($1::timestamptz, now()) - make_interval(secs => $2)
)
SELECT (SELECT count(*) FROM old WHERE NOT owed AND NOT running) AS tasks,
       (SELECT count(DISTINCT result_uri) FROM old
        WHERE NOT owed AND NOT running AND result_uri IS NOT NULL AND result_expired_at IS NULL) AS results,
       (SELECT count(*) FROM reusable_result
        WHERE created_at < COALESCE($1::timestamptz, now()) - make_interval(secs => $2)) AS reusable_results,
       (SELECT count(*) FROM old WHERE owed) AS kept_webhook,
       (SELECT count(*) FROM old WHERE running AND NOT owed) AS kept_running;

-- name: admin_deliveries
-- Webhook deliveries in a state ($1 NULL: every state), newest first, keyset-paged: $2/$3 the last row's created_at
-- and id, $4 limit. last_attempt_at from the attempt log.
SELECT d.id, d.task_id, d.user_id, d.webhook_id, d.event_type, d.url, d.status, d.attempts, d.last_status_code,
       d.last_error, d.created_at, d.next_attempt_at,
       (SELECT max(a.at) FROM callback_attempt a WHERE a.delivery_id = d.id) AS last_attempt_at
FROM callback_delivery d
WHERE ($1::text IS NULL OR d.status = $1)
  AND ($2::timestamptz IS NULL OR (d.created_at, d.id) < ($2, $3::bigint))
ORDER BY d.created_at DESC, d.id DESC
LIMIT $4;

-- name: retention_ended_checkpoints
-- Forgets the step checkpoints of ended tasks (their worker did not: cancelled, timed out, or it died), oldest first,
-- skipping locked rows; returns their objects (the newest and the garbage) for the caller to delete inside the same
-- transaction. $1 limit.
UPDATE task t SET checkpoint_uri = NULL, checkpoint_garbage = '{}'
FROM (SELECT id, checkpoint_uri AS uri, checkpoint_garbage AS garbage FROM task
      WHERE finished_at IS NOT NULL AND (checkpoint_uri IS NOT NULL OR checkpoint_garbage <> '{}')
      ORDER BY finished_at
      LIMIT $1
      FOR UPDATE SKIP LOCKED) o
WHERE t.id = o.id
RETURNING o.uri, o.garbage;

-- name: sched_preempt
-- Per model that allows preemption: when a due QUEUED task has waited longer than the model's preempt_after and no
-- task of the model was preempted within that time, marks the running attempt of lower priority with the most work
-- left (never one preempted within the window) and returns it, for its worker to be told. $1 now, $2 model ids,
-- $3 their preempt_after seconds, $4 window seconds.
WITH m AS (SELECT * FROM unnest($2::text[], $3::float8[]) AS m(model_id, secs)),
waiting AS (
    SELECT m.model_id, max(q.priority) AS priority
    FROM m JOIN task q ON q.model_id = m.model_id AND q.status = 'QUEUED'
    WHERE q.queued_at < COALESCE($1::timestamptz, now()) - make_interval(secs => m.secs)
      AND (q.not_before IS NULL OR q.not_before <= COALESCE($1::timestamptz, now()))
      AND NOT EXISTS (SELECT 1 FROM task x
                      WHERE x.model_id = m.model_id AND x.preempted_at IS NOT NULL
                        AND x.preempted_at > COALESCE($1::timestamptz, now()) - make_interval(secs => m.secs))
    GROUP BY m.model_id
),
victim AS (
    SELECT DISTINCT ON (w.model_id) r.id
    FROM waiting w JOIN task r ON r.model_id = w.model_id
    WHERE r.status = 'PROCESSING' AND r.lease_expires_at > COALESCE($1::timestamptz, now()) AND r.priority < w.priority
      AND (r.preempted_at IS NULL OR r.preempted_at < COALESCE($1::timestamptz, now()) - make_interval(secs => $4))
    ORDER BY w.model_id, r.priority, r.progress, r.id
)
UPDATE task t SET preempted_at = COALESCE($1::timestamptz, now())
FROM victim v
WHERE t.id = v.id AND t.status::text = 'PROCESSING'  -- text: the victim by primary key, not task_lease_idx (#38)
RETURNING t.id, t.attempt, t.model_id, t.trace_context;

-- name: admin_task_previews
-- A task's preview images, oldest first (the newest last), as its attempts named them. $1 task id.
SELECT preview_uris FROM task WHERE id = $1;
