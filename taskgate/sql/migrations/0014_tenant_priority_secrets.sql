-- Issue 16 (submit/admin): a tenant's highest allowed priority (1 LOW, 5 NORMAL, 10 HIGH); HIGH is an entitlement.
ALTER TABLE tenant ADD COLUMN max_priority smallint NOT NULL DEFAULT 5 CHECK (max_priority IN (1, 5, 10));

-- `admin deliveries --status FAILED`: deliveries of one state, newest first.
CREATE INDEX callback_delivery_status_created_idx ON callback_delivery (status, created_at DESC, id DESC);
