-- Preview images of a running video (services/worker/partial.py): each object is named here by its attempt before it
-- is stored, so retention deletes every preview with the task's output (retain_results) or its row (retain_tasks),
-- and a worker killed between naming and storing leaves nothing that no row names.
ALTER TABLE task ADD COLUMN preview_uris text[] NOT NULL DEFAULT '{}';

-- finished tasks whose previews may still be stored
CREATE INDEX task_previews_ended_idx ON task (finished_at) WHERE finished_at IS NOT NULL AND preview_uris <> '{}';
