-- Fair share one level down (#35): inside a tenant's turn its end users take turns, by the same stride scheduling as
-- across tenants (functions/worker_claim.sql), so one end user's bulk cannot make the tenant's other users wait.

-- Each end user's pass per level and tenant (a claim advances it by 1); an end user without a row starts at its
-- tenant's end-user floor, kept on the tenant's fair_share row (the pass of its latest winning end user).
CREATE TABLE end_user_share (
    model_id text NOT NULL,
    priority smallint NOT NULL,
    user_id  text NOT NULL,
    end_user text NOT NULL,
    pass     double precision NOT NULL,
    PRIMARY KEY (model_id, priority, user_id, end_user)
);
ALTER TABLE fair_share ADD COLUMN end_user_floor double precision NOT NULL DEFAULT 0;

-- The claim's walk inside a tenant: its end users with QUEUED tasks in a level (a skip scan), and each one's oldest.
CREATE INDEX task_fair_end_user_idx ON task (model_id, priority, user_id, end_user, queued_at, id) WHERE status = 'QUEUED';
