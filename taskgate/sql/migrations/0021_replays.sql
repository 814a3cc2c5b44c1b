-- Replays: an operator replays a FAILED or TIMEOUT task (RequeueTasks with replay_finished) as a new task with the
-- same request, since terminal states stay terminal. The link is kept both ways: the new task names its source
-- (task.replay_of), and the source's dead letter names its replay and when it was made. Neither is a foreign key: a
-- task purged by retention leaves the other side's id as a record, and a purge deletes no more than it did.
ALTER TABLE task ADD COLUMN replay_of bigint;

-- One replay per task: a replay command sent again (after a lost answer, or a batch that stopped on an error)
-- makes no second copy; a replay that failed too is replayed itself. Also how a replay finds an earlier one.
CREATE UNIQUE INDEX task_replay_of_idx ON task (replay_of) WHERE replay_of IS NOT NULL;

ALTER TABLE dead_letter
    ADD COLUMN replayed_as bigint,
    ADD COLUMN replayed_at timestamptz,
    ADD CONSTRAINT dead_letter_replay_check CHECK ((replayed_as IS NULL) = (replayed_at IS NULL));

-- insert_tasks (functions/submit_fast_path.sql) gains p_replay_of; CREATE OR REPLACE cannot add a parameter.
DROP FUNCTION IF EXISTS insert_tasks(bigint[], text[], text[], boolean[], text[], text[], text[], text[], jsonb[], jsonb[],
                                     smallint[], text[], integer[], text[], text[], jsonb[], boolean[]);
