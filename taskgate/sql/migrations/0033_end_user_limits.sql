-- Limits per end user inside a tenant's (#35): a tenant's own overrides of max_pending_per_end_user and
-- submits_per_minute_per_end_user (NULL: the global settings), and each end user's minute windows, shared by every
-- submit replica like the tenant's (rate_window). Old windows go as their tenant submits again: (tenant, start).
ALTER TABLE tenant ADD COLUMN max_pending_per_end_user integer CHECK (max_pending_per_end_user > 0),
                   ADD COLUMN submits_per_minute_per_end_user integer CHECK (submits_per_minute_per_end_user > 0);

CREATE TABLE end_user_rate_window (
    tenant_id    text NOT NULL,
    end_user     text NOT NULL,
    window_start timestamptz NOT NULL,
    count        integer NOT NULL,
    PRIMARY KEY (tenant_id, end_user, window_start)
);
CREATE INDEX end_user_rate_window_age_idx ON end_user_rate_window (tenant_id, window_start);

-- submit_tasks answers which limit refused an item (limit_scope, rate_limit): a new result type.
DROP FUNCTION IF EXISTS submit_tasks(bigint[], text[], text[], boolean[], text[], text[], text[], text[], jsonb[], jsonb[],
                                     smallint[], text[], integer[], text[], text[], jsonb[], timestamptz[], float8[],
                                     integer[], integer, float8[], float8, integer, timestamptz, text[]);
