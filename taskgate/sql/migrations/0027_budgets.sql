-- GPU-second budgets at admission: a tenant's budget per UTC day and per UTC month (NULL: none), what each task
-- reserved when it was admitted (its estimate) and the day it was charged to, and each tenant's charges per day
-- (reservations, settled to the measured device seconds when the task ends; functions/usage.sql).
ALTER TABLE tenant ADD COLUMN gpu_seconds_per_day float8 CHECK (gpu_seconds_per_day > 0),
                   ADD COLUMN gpu_seconds_per_month float8 CHECK (gpu_seconds_per_month > 0);

ALTER TABLE task ADD COLUMN gpu_reserved float8 NOT NULL DEFAULT 0 CHECK (gpu_reserved >= 0),
                 ADD COLUMN budget_day date;  -- NULL: its tenant had no budget when it was admitted

CREATE TABLE budget_charge (
    tenant_id text NOT NULL,
    day       date NOT NULL,  -- the UTC day the tasks were admitted on
    seconds   float8 NOT NULL DEFAULT 0,
    PRIMARY KEY (tenant_id, day)
);

-- submit_tasks and insert_tasks take the estimates, the budgets' clock and answer what is left: new signatures.
DROP FUNCTION IF EXISTS submit_tasks(bigint[], text[], text[], boolean[], text[], text[], text[], text[], jsonb[], jsonb[],
                                     smallint[], text[], integer[], text[], text[], jsonb[], integer[], integer);
DROP FUNCTION IF EXISTS insert_tasks(bigint[], text[], text[], boolean[], text[], text[], text[], text[], jsonb[], jsonb[],
                                     smallint[], text[], integer[], text[], text[], jsonb[], boolean[], bigint[]);
