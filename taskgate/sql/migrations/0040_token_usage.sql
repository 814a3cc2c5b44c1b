-- Metering in tokens (#34): chat tasks' input and output tokens summed per tenant, model, end user and hour beside
-- the seconds (functions/usage.sql adds a task's tokens when its answer is recorded).
ALTER TABLE usage_hour ADD COLUMN input_tokens bigint NOT NULL DEFAULT 0,
                       ADD COLUMN output_tokens bigint NOT NULL DEFAULT 0;
