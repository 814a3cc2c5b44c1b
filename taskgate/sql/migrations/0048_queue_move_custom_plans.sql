-- The dispatcher's CREATED -> QUEUED move is a top-level statement again (queries/submit.sql, submit_queue_created),
-- planned for each call's ids. Run inside queue_created_tasks with a forced generic plan it kept whatever plan the
-- first call got: in a bench's bulk phase, started on a near-empty table, that plan took 0.96 ms a task against
-- 0.18 ms planned per call (#38), and the dispatch fell 3.5 s behind the answers.
DROP FUNCTION IF EXISTS queue_created_tasks(bigint[], text, text);
