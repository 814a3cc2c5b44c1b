-- name: file_insert
-- Records a tenant's stored file (its object already written); @batch_id NULL: none.
INSERT INTO stored_file (id, user_id, purpose, filename, uri, size_bytes, sha256, batch_id)
VALUES (@file_id, @user_id, @purpose, @filename, @uri, @size_bytes, @sha256, @batch_id)
RETURNING *;

-- name: file_get
-- One of a tenant's files. $1 user, $2 id.
SELECT * FROM stored_file WHERE user_id = $1 AND id = $2;

-- name: file_list
-- A page of a tenant's files, newest first, after a cursor id. $1 user, $2 purpose ('' = any), $3 after id (or
-- NULL), $4 limit.
SELECT * FROM stored_file
WHERE user_id = $1 AND ($2 = '' OR purpose = $2) AND ($3::bigint IS NULL OR id < $3)
ORDER BY id DESC LIMIT $4;

-- name: batch_insert
-- A new batch, validating, its lease taken by the ingest that starts it (@window_seconds: its completion window in
-- seconds; @source_file_id NULL: none).
INSERT INTO task_batch (id, user_id, end_user, input_file_id, endpoint, completion_window, metadata, expires_at,
                        lease_until, source_file_id)
VALUES (@batch_id, @user_id, @end_user, @input_file_id, @endpoint, @completion_window, @metadata, now() + make_interval(secs => @window_seconds), now() + make_interval(secs => @lease_seconds), @source_file_id)
RETURNING *;

-- name: batch_get
-- One of a tenant's batches with its counts from its lines' tasks. $1 user, $2 id.
SELECT b.*, c.* FROM task_batch b,
     LATERAL (SELECT count(*) FILTER (WHERE t.status = 'SUCCEEDED') AS done,
                     count(*) FILTER (WHERE i.task_id IS NULL OR t.status IN ('FAILED', 'TIMEOUT', 'CANCELED')) AS failed,
                     count(*) FILTER (WHERE t.status IN ('CREATED', 'QUEUED', 'PROCESSING')) AS unfinished,
                     count(*) FILTER (WHERE t.error_code = 'QUEUE_TTL_EXPIRED') AS expired
              FROM batch_item i LEFT JOIN task t ON t.id = i.task_id WHERE i.batch_id = b.id) c
WHERE b.user_id = $1 AND b.id = $2;

-- name: batch_list
-- A page of a tenant's batches, newest first, after a cursor id, with their counts. $1 user, $2 after id (or NULL),
-- $3 limit.
SELECT b.*, c.* FROM (SELECT * FROM task_batch WHERE user_id = $1 AND ($2::bigint IS NULL OR id < $2)
                      ORDER BY id DESC LIMIT $3) b,
     LATERAL (SELECT count(*) FILTER (WHERE t.status = 'SUCCEEDED') AS done,
                     count(*) FILTER (WHERE i.task_id IS NULL OR t.status IN ('FAILED', 'TIMEOUT', 'CANCELED')) AS failed,
                     count(*) FILTER (WHERE t.status IN ('CREATED', 'QUEUED', 'PROCESSING')) AS unfinished,
                     count(*) FILTER (WHERE t.error_code = 'QUEUE_TTL_EXPIRED') AS expired
              FROM batch_item i LEFT JOIN task t ON t.id = i.task_id WHERE i.batch_id = b.id) c
ORDER BY b.id DESC;

-- name: batch_take_lease
-- The batch's lease for whoever ingests or finalizes it, when it is in one of those states and nobody holds it (or
-- the holder's lapsed: it died). No row: not to be taken. $1 id, $2 lease seconds.
UPDATE task_batch SET lease_until = now() + make_interval(secs => $2)
WHERE id = $1 AND status IN ('validating', 'finalizing') AND (lease_until IS NULL OR lease_until < now())
RETURNING *;

-- name: batch_set_total
-- The input's line count, once read (the same every time it is read). $1 id, $2 lines.
UPDATE task_batch SET total_lines = $2 WHERE id = $1 AND total_lines IS NULL;

-- name: batch_record
-- A chunk of lines submitted: their tasks or refusals recorded with the ingest's progress, guarded by the progress
-- the ingest started the chunk from (a second ingest records nothing and stops), the lease renewed; the last chunk
-- moves a validating batch to in_progress. @start: the line the chunk starts from; @lines, @custom_ids, @task_ids
-- and @errors one element per line. No row: another ingest recorded them, or the batch is no longer validating.
WITH moved AS (
    UPDATE task_batch SET ingested_lines = @start + cardinality(@lines::int[]),
                          lease_until = CASE WHEN status = 'cancelling' OR @start + cardinality(@lines::int[]) >= total_lines
                                             THEN NULL
                                             ELSE now() + make_interval(secs => @lease_seconds) END,
                          status = CASE WHEN status = 'validating' AND @start + cardinality(@lines::int[]) >= total_lines
                                        THEN 'in_progress' ELSE status END,
                          in_progress_at = CASE WHEN status = 'validating' AND @start + cardinality(@lines::int[]) >= total_lines
                                                THEN now() ELSE in_progress_at END
    WHERE id = @batch_id AND ingested_lines = @start AND status IN ('validating', 'cancelling')
    RETURNING id
)
INSERT INTO batch_item (batch_id, line, custom_id, task_id, error)
SELECT moved.id, u.line, u.custom_id, u.task_id, u.error
FROM moved, unnest(@lines::int[], @custom_ids::text[], @task_ids::bigint[], @errors::jsonb[]) AS u(line, custom_id, task_id, error)
RETURNING line;

-- name: batch_renew
-- The ingest's lease renewed while it waits out a refusal, when the batch still takes lines from where it is. $1 id,
-- $2 its progress, $3 lease seconds. No row: it no longer does.
UPDATE task_batch SET lease_until = now() + make_interval(secs => $3)
WHERE id = $1 AND status = 'validating' AND ingested_lines = $2
RETURNING id;

-- name: batch_fail
-- A batch whose input could not be read as lines: failed, saying why. $1 id, $2 message.
UPDATE task_batch SET status = 'failed', failed_at = now(), error_message = $2, lease_until = NULL
WHERE id = $1 AND status IN ('validating', 'cancelling')
RETURNING *;

-- name: batch_finalize
-- A batch whose lines were all submitted and whose tasks all finished moves to finalizing under a lease (one
-- finalizer). $1 id, $2 lease seconds.
UPDATE task_batch SET status = 'finalizing', finalizing_at = now(), lease_until = now() + make_interval(secs => $2)
WHERE id = $1 AND status = 'in_progress'
  AND NOT EXISTS (SELECT 1 FROM batch_item i JOIN task t ON t.id = i.task_id
                  WHERE i.batch_id = $1 AND t.status IN ('CREATED', 'QUEUED', 'PROCESSING'))
RETURNING *;

-- name: batch_cancelled_finalize
-- A cancelling batch whose submitted tasks all finished: its files are written next (finalizing's lease, kept in
-- cancelling). $1 id, $2 lease seconds.
UPDATE task_batch SET lease_until = now() + make_interval(secs => $2)
WHERE id = $1 AND status = 'cancelling' AND (lease_until IS NULL OR lease_until < now())
  AND NOT EXISTS (SELECT 1 FROM batch_item i JOIN task t ON t.id = i.task_id
                  WHERE i.batch_id = $1 AND t.status IN ('CREATED', 'QUEUED', 'PROCESSING'))
RETURNING *;

-- name: batch_items
-- A batch's lines in order with their tasks (NULL columns for a refused line). $1 id.
SELECT i.line, i.custom_id, i.error, t.* FROM batch_item i LEFT JOIN task t ON t.id = i.task_id
WHERE i.batch_id = $1 ORDER BY i.line;

-- name: batch_unfinished_tasks
-- The ids of a batch's tasks not finished yet. $1 id.
SELECT t.id FROM batch_item i JOIN task t ON t.id = i.task_id
WHERE i.batch_id = $1 AND t.status IN ('CREATED', 'QUEUED', 'PROCESSING');

-- name: batch_complete
-- A finalizing (or cancelling) batch with its files written: completed (expired when a line's queue TTL passed),
-- or cancelled. $1 id, $2 output file, $3 error file, $4 expired.
UPDATE task_batch SET output_file_id = $2, error_file_id = $3, lease_until = NULL,
                      status = CASE WHEN status = 'cancelling' THEN 'cancelled' WHEN $4 THEN 'expired' ELSE 'completed' END,
                      completed_at = CASE WHEN status = 'finalizing' THEN now() END,
                      cancelled_at = CASE WHEN status = 'cancelling' THEN now() END
WHERE id = $1 AND status IN ('finalizing', 'cancelling')
RETURNING *;

-- name: batch_cancel
-- A batch not yet finished moves to cancelling (its ingest stops at its next chunk; its lease lapses so whoever
-- reads it next can finish it). $1 user, $2 id.
UPDATE task_batch SET status = 'cancelling', cancelling_at = now(), lease_until = NULL
WHERE user_id = $1 AND id = $2 AND status IN ('validating', 'in_progress')
RETURNING *;
