-- Usage per end user (#35): the hourly sums per tenant and model are also per end user ('' for the tenant's own
-- tasks), so a backend can bill its own users; a tenant's figures are the sum over its end users. Existing rows are
-- the tenant's own ('').
ALTER TABLE usage_hour ADD COLUMN end_user text NOT NULL DEFAULT '';
ALTER TABLE usage_hour DROP CONSTRAINT usage_hour_pkey;
ALTER TABLE usage_hour ADD PRIMARY KEY (tenant_id, hour, model_id, end_user);
