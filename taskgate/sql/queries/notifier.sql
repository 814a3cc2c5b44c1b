-- The notifier: the event relay (task_event -> JetStream), the callback outbox, and the event streams.

-- name: relay_lock
-- One relay pass at a time across replicas (keeps per-task order and relay-time order); the pass's relay time. $1 key.
SELECT pg_try_advisory_xact_lock($1) AS locked, clock_timestamp() AS at;

-- name: relay_take_events
-- The oldest events not yet on JetStream (the relay's outbox), locked for this pass, with what the webhook outbox
-- needs of their task (and its trace context). Each event and its task read by primary key (LATERAL ... LIMIT 1:
-- never flattened into a join, so no cached generic plan can hash-join whole tables; see relay_lock_take). $1 limit.
SELECT e.*, t.callback_url, t.callback_events, t.created_at AS task_created_at, t.queued_at AS task_queued_at,
       t.started_at AS task_started_at, t.finished_at AS task_finished_at, t.metadata AS task_metadata,
       t.result_reused AS task_result_reused, t.trace_context AS task_trace_context,
       t.device_seconds AS task_device_seconds, t.slot_seconds AS task_slot_seconds,
       t.input_tokens AS task_input_tokens, t.output_tokens AS task_output_tokens
FROM (SELECT o.event_id FROM event_outbox o ORDER BY o.event_id LIMIT $1 FOR UPDATE SKIP LOCKED) o
CROSS JOIN LATERAL (SELECT * FROM task_event x WHERE x.id = o.event_id LIMIT 1) e
CROSS JOIN LATERAL (SELECT * FROM task y WHERE y.id = e.task_id LIMIT 1) t
ORDER BY e.id;

-- name: relay_lock_take
-- relay_lock and relay_take_events in one round trip: the lock (none of the outbox is read or locked without it),
-- the pass's relay time, and its events. One row with NULL event columns when the lock went to another replica or
-- the outbox is empty. $1 key, $2 limit.
-- Each event and its task are read by primary key: LATERAL subqueries with LIMIT 1 are never flattened into joins.
-- As plain joins, the plan cache's generic plan (the statement runs on every pass, so it is used after five) could not
-- know the limit and hash-joined whole tables: a sequential scan of task_event and of task on every pass (#38: 7.4 ms
-- a pass at bench size, the relay's statement the busiest in the database after the admission).
WITH lock AS MATERIALIZED (SELECT pg_try_advisory_xact_lock($1) AS locked, clock_timestamp() AS at)
SELECT l.locked AS relay_locked, l.at AS relay_at, r.*
FROM lock l
LEFT JOIN LATERAL (
    SELECT e.*, t.callback_url, t.callback_events, t.created_at AS task_created_at, t.queued_at AS task_queued_at,
           t.started_at AS task_started_at, t.finished_at AS task_finished_at, t.metadata AS task_metadata,
           t.result_reused AS task_result_reused, t.trace_context AS task_trace_context,
           t.device_seconds AS task_device_seconds, t.slot_seconds AS task_slot_seconds,
           t.input_tokens AS task_input_tokens, t.output_tokens AS task_output_tokens
    FROM (SELECT o.event_id FROM event_outbox o WHERE l.locked ORDER BY o.event_id LIMIT $2 FOR UPDATE SKIP LOCKED) o
    CROSS JOIN LATERAL (SELECT * FROM task_event x WHERE x.id = o.event_id LIMIT 1) e
    CROSS JOIN LATERAL (SELECT * FROM task y WHERE y.id = e.task_id LIMIT 1) t
) r ON true
ORDER BY r.id;

-- name: relay_mark_published
-- Records that events are on JetStream: out of the outbox, and one row for the pass (the event rows stay as they
-- were written). $1 event ids, $2 the pass's relay time.
WITH relayed AS (
    DELETE FROM event_outbox WHERE event_id = ANY($1::bigint[]) RETURNING event_id
)
INSERT INTO relay_pass (at, first_event, last_event)
SELECT $2, min(event_id), max(event_id) FROM relayed HAVING count(*) > 0;

-- name: relay_lag
-- Seconds since the oldest event not yet relayed was written (0 when none).
SELECT COALESCE(EXTRACT(EPOCH FROM clock_timestamp() - (
    SELECT e.at FROM task_event e WHERE e.id = (SELECT min(event_id) FROM event_outbox))), 0)::float8;

-- name: outbox_insert_delivery
-- A webhook to send for one event (idempotent per event and url), not due before its destination's breaker closes;
-- the task's older progress webhooks to the same url that are still waiting (not in flight) go: only the newest
-- progress is worth sending. @first_delay the seconds before the first attempt; @trace_context NULL: tracing off.
WITH added AS (
    INSERT INTO callback_delivery (task_id, event_id, user_id, webhook_id, event_type, url, payload, next_attempt_at,
                                   trace_context)
    VALUES (@task_id, @event_id, @user_id, @webhook_id, @event_type, @url, @payload,
            greatest(now() + make_interval(secs => @first_delay),
                     (SELECT w.open_until FROM webhook_destination w WHERE w.destination = webhook_destination_of(@url))),
            @trace_context)
    ON CONFLICT DO NOTHING
    RETURNING task_id, event_id, url
)
DELETE FROM callback_delivery d USING added a
WHERE d.task_id = a.task_id AND d.url = a.url AND d.event_id < a.event_id AND d.event_type = 'task.progress'
  AND d.status = 'PENDING' AND (d.lease_expires_at IS NULL OR d.lease_expires_at < now());

-- name: callback_move_status
-- The one writer of task.callback_status: a move only from a status states.CALLBACK_LEGAL allows. $1 task ids,
-- $2 new status, $3 the allowed current statuses, $4 callback_retry (NULL: unchanged).
UPDATE task SET callback_status = $2, callback_retry = COALESCE($4, callback_retry)
WHERE id = ANY($1::bigint[]) AND callback_url IS NOT NULL AND callback_status = ANY($3::text[])
RETURNING id;

-- name: outbox_redeliver
-- Starts a new delivery round, same webhook ids, for a task's terminal webhooks (and, with $2, its progress ones).
-- A lease in flight is kept, so no second replica sends the same delivery meanwhile. $1 task id, $2 with progress.
WITH d AS (
    UPDATE callback_delivery
    SET status = 'PENDING', next_attempt_at = now(), round_start = attempts, delivered_at = NULL
    WHERE task_id = $1 AND ($2 OR event_type <> 'task.progress')
    RETURNING id, webhook_id, event_type, status, attempts
)
SELECT * FROM d ORDER BY id;

-- name: outbox_wake
-- Wakes every notifier's webhook sender (delivered at commit). $1 payload (a task id).
SELECT pg_notify('taskgate_webhook', $1::text);

-- name: webhook_claim
-- Due deliveries of one lane (@progress: the progress lane, else the terminal one) for this sender, leased so no other
-- replica sends them meanwhile, fair across destinations: round-robin (each destination's oldest first), never more
-- than @per_destination in flight to one destination over every replica (one while its breaker is half-open:
-- @breaker_failures failures or more), none while its breaker is open.
WITH busy AS (
    SELECT destination, count(*)::integer AS n FROM callback_delivery
    WHERE lease_owner IS NOT NULL AND lease_expires_at >= now() AND status = 'PENDING'
    GROUP BY destination
), candidate AS (
    SELECT c.id FROM (
        SELECT d.id, d.next_attempt_at,
               row_number() OVER (PARTITION BY d.destination ORDER BY d.next_attempt_at, d.id) + coalesce(b.n, 0) AS nth,
               CASE WHEN coalesce(w.failures, 0) >= @breaker_failures THEN 1 ELSE @per_destination END AS cap
        FROM callback_delivery d
        LEFT JOIN busy b ON b.destination = d.destination
        LEFT JOIN webhook_destination w ON w.destination = d.destination
        WHERE d.status = 'PENDING' AND d.next_attempt_at <= now()
          AND (d.lease_expires_at IS NULL OR d.lease_expires_at < now())
          AND (d.event_type = 'task.progress') = @progress
          AND (w.open_until IS NULL OR w.open_until <= now())
    ) c
    WHERE c.nth <= c.cap
    ORDER BY c.nth, c.next_attempt_at, c.id
    LIMIT @limit
), due AS (
    SELECT d.id FROM callback_delivery d JOIN candidate USING (id)
    WHERE d.status = 'PENDING' AND (d.lease_expires_at IS NULL OR d.lease_expires_at < now())
    FOR UPDATE OF d SKIP LOCKED
)
UPDATE callback_delivery d SET lease_owner = @owner, lease_expires_at = now() + make_interval(secs => @lease_seconds)
FROM due WHERE d.id = due.id
RETURNING d.*;

-- name: webhook_breaker_closed
-- An attempt the destination answered (not a 5xx): its breaker closes. $1 destination.
DELETE FROM webhook_destination WHERE destination = $1;

-- name: webhook_breaker_failed
-- An attempt the destination failed (5xx, timeout, no answer): one more consecutive failure; at $2 the breaker opens
-- for $3 seconds and the destination's waiting deliveries are put off until it closes. Returns the open_until set
-- (NULL: still closed). $1 destination.
WITH counted AS (
    INSERT INTO webhook_destination AS w (destination, failures, open_until)
    VALUES ($1, 1, CASE WHEN $2 <= 1 THEN now() + make_interval(secs => $3) END)
    ON CONFLICT (destination) DO UPDATE
    SET failures = w.failures + 1,
        open_until = CASE WHEN w.failures + 1 >= $2 THEN now() + make_interval(secs => $3) ELSE w.open_until END
    RETURNING w.failures, w.open_until
), put_off AS (
    UPDATE callback_delivery d SET next_attempt_at = c.open_until
    FROM counted c
    WHERE c.failures >= $2 AND d.destination = $1 AND d.status = 'PENDING' AND d.next_attempt_at < c.open_until
      AND (d.lease_expires_at IS NULL OR d.lease_expires_at < now())
)
SELECT CASE WHEN failures >= $2 THEN open_until END AS open_until FROM counted;

-- name: webhook_next_due
-- Seconds until the next pending delivery is due (NULL when none; GREATEST would turn that NULL into 0, "due now").
SELECT CASE WHEN min(next_attempt_at) IS NOT NULL THEN GREATEST(EXTRACT(EPOCH FROM min(next_attempt_at) - now()), 0) END::float8
FROM callback_delivery WHERE status = 'PENDING';

-- name: webhook_record
-- The outcome of one attempt, only while this sender holds the lease: its new @status, @delay_seconds to the next
-- attempt (PENDING), the HTTP @status_code and an excerpt of the @error.
UPDATE callback_delivery
SET status = @status, attempts = attempts + 1, lease_owner = NULL, lease_expires_at = NULL,
    next_attempt_at = CASE WHEN @status = 'PENDING' THEN now() + make_interval(secs => @delay_seconds) ELSE next_attempt_at END,
    delivered_at = CASE WHEN @status = 'DELIVERED' THEN now() END,
    last_status_code = @status_code, last_error = @error
WHERE id = @delivery_id AND lease_owner = @owner AND status = 'PENDING'
RETURNING id, task_id, attempts, round_start, event_type;

-- name: webhook_insert_attempt
-- The log of one attempt (@attempt: its number).
INSERT INTO callback_attempt (delivery_id, attempt, webhook_id, status_code, latency_ms, error)
VALUES (@delivery_id, @attempt, @webhook_id, @status_code, @latency_ms, @error)
ON CONFLICT (delivery_id, attempt) DO NOTHING;

-- name: stream_task_events
-- A task's events with version in ($2, $3], in version order. $1 task id.
SELECT * FROM task_event WHERE task_id = $1 AND version > $2 AND version <= $3 ORDER BY version;

-- name: stream_events_at
-- The events of these (task, version) pairs, in task and version order: the versions their committers hinted.
-- $1 task ids, $2 versions (same length).
SELECT e.* FROM task_event e
JOIN unnest($1::bigint[], $2::bigint[]) AS h(task_id, version) ON e.task_id = h.task_id AND e.version = h.version
ORDER BY e.task_id, e.version;

-- name: stream_user_events_after
-- A tenant's events after a cursor, in id order, one page. $1 user, $2 cursor id, $3 limit.
SELECT * FROM task_event WHERE user_id = $1 AND id > $2 ORDER BY id LIMIT $3;

-- name: stream_user_events_lookback
-- A tenant's events at or before the cursor id that may not have reached the subscriber (ids commit out of order):
-- those not yet relayed, and those relayed in or after the cursor's pass. Passes record only the id span they
-- published, so this returns a superset (from the smallest id any later pass published), which the stream
-- de-duplicates by version. $1 user, $2 cursor id, $3 the cursor's relay time (NULL: not relayed yet).
SELECT * FROM task_event e
WHERE e.user_id = $1 AND e.id <= $2
  AND (e.id >= (SELECT min(p.first_event) FROM relay_pass p WHERE p.at >= $3)
       OR EXISTS (SELECT 1 FROM event_outbox o WHERE o.event_id = e.id))
ORDER BY e.id;

-- name: stream_cursor_time
-- When the cursor's event was relayed: the earliest pass whose id span holds it (NULL: not relayed yet, or not the
-- tenant's). $1 event id, $2 user.
SELECT (SELECT min(p.at) FROM relay_pass p WHERE p.last_event >= e.id AND p.first_event <= e.id)
FROM task_event e
WHERE e.id = $1 AND e.user_id = $2 AND NOT EXISTS (SELECT 1 FROM event_outbox o WHERE o.event_id = e.id);

-- name: stream_user_last_event
-- The newest event id of a tenant (0 when none): the cursor of "from now". $1 user.
SELECT COALESCE(max(id), 0) FROM task_event WHERE user_id = $1;

-- name: stream_task_versions
-- The version of each task that exists, for the quiet WatchTask streams of one keep-alive tick. $1 task ids.
SELECT id, version FROM task WHERE id = ANY($1::bigint[]);

-- name: stream_users_last_events
-- The newest event id of each tenant (0 when none), for the quiet WatchTasks streams of one keep-alive tick. $1 users.
SELECT u AS user_id, COALESCE((SELECT max(e.id) FROM task_event e WHERE e.user_id = u), 0) AS last_id
FROM unnest($1::text[]) AS u;
