-- Bystanders of a poison task (docs/operations.md, "Poison tasks"): a worker death is counted per task as alone (the
-- worker held only that task: counted in worker_losses, toward max_worker_losses) or in company (it held others too:
-- counted in company_losses, not toward the cap, since any of them may have killed it). A task that lost a worker
-- either way runs alone from then on (run_alone: claimed only by a worker that holds nothing else, which takes
-- nothing else while it runs), so each of its later deaths is its own. A worker that holds tasks and meets a run_alone
-- task in its level reserves it (alone_for) and drains: it takes nothing new until it is empty, then claims it; an
-- empty worker may claim any run_alone task, reserved or not.
ALTER TABLE task
    ADD COLUMN company_losses integer NOT NULL DEFAULT 0 CHECK (company_losses >= 0),
    ADD COLUMN run_alone boolean NOT NULL DEFAULT false,
    ADD COLUMN alone_for text;

-- the run_alone tasks not yet finished (few, and only after a worker death): the claim looks here first
CREATE INDEX task_run_alone_idx ON task (model_id, priority, queued_at, id)
    WHERE run_alone AND status IN ('QUEUED', 'PROCESSING');

-- A worker found lost: how many tasks it held when its first lost lease was found (this one included), so each of
-- its tasks, found over several scans or takeovers, is judged by the same count. NULL: none found lost since its last
-- heartbeat.
ALTER TABLE worker
    ADD COLUMN lost_holding integer,
    ADD COLUMN lost_at timestamptz;
