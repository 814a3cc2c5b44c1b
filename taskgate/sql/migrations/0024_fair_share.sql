-- Issue 24: fair share inside a priority. A dispatch message is a hint for its (model, priority) level; a claim takes
-- the fairest QUEUED task of the level by stride scheduling over tenants (functions/worker_claim.sql).

-- A tenant's share against other tenants of one priority: a claim advances its pass by 1 / share_weight.
ALTER TABLE tenant ADD COLUMN share_weight double precision NOT NULL DEFAULT 1 CHECK (share_weight > 0);

-- Each tenant's pass per level: the tenant with the lowest pass among those with a due QUEUED task is served next.
CREATE TABLE fair_share (
    model_id text NOT NULL,
    priority smallint NOT NULL,
    user_id  text NOT NULL,
    pass     double precision NOT NULL,
    PRIMARY KEY (model_id, priority, user_id)
);

-- Each level's floor: the pass of its latest winner. A tenant's pass counts from at least here, so a tenant that
-- (re)joins competes from now on, with no credit banked while it had nothing queued.
CREATE TABLE fair_level (
    model_id text NOT NULL,
    priority smallint NOT NULL,
    floor    double precision NOT NULL,
    PRIMARY KEY (model_id, priority)
);

-- The claim's walk: the tenants with QUEUED tasks in a level (a skip scan), and each one's oldest.
CREATE INDEX task_fair_idx ON task (model_id, priority, user_id, queued_at, id) WHERE status = 'QUEUED';
-- The claim's wait when nothing in a level is due yet (a retry backoff).
CREATE INDEX task_not_before_idx ON task (model_id, priority, not_before) WHERE status = 'QUEUED' AND not_before IS NOT NULL;

-- worker_claim gains an OUT parameter (functions/ recreates it).
DROP FUNCTION IF EXISTS worker_claim(bigint, text, integer, boolean, text, double precision, integer, text, text);
