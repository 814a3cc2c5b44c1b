-- Metering: each task's measured seconds, summed over its attempts (a retried attempt's count: the device was
-- busy), and the same summed per tenant, model and UTC hour (functions/usage.sql keeps the sums from the task rows).
-- device_seconds: time an attempt held its device (the model's device phase); slot_seconds: time it held a slot.
ALTER TABLE task ADD COLUMN device_seconds float8 NOT NULL DEFAULT 0 CHECK (device_seconds >= 0),
                 ADD COLUMN slot_seconds float8 NOT NULL DEFAULT 0 CHECK (slot_seconds >= 0);

CREATE TABLE usage_hour (
    tenant_id      text NOT NULL,
    hour           timestamptz NOT NULL,  -- the UTC hour the attempts ended in
    model_id       text NOT NULL,
    device_seconds float8 NOT NULL DEFAULT 0,
    slot_seconds   float8 NOT NULL DEFAULT 0,
    attempts       bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (tenant_id, hour, model_id)
);
CREATE INDEX usage_hour_hour_idx ON usage_hour (hour);
