-- Metering's sums: an attempt's final move adds its measured seconds (the wasted ones apart) to the task row, and this
-- adds the same to the tenant's, model's, end user's and hour's row in the same statement, whichever move it was
-- (succeed, fail, retry, release).
CREATE OR REPLACE FUNCTION task_record_usage() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO usage_hour AS u (tenant_id, hour, model_id, end_user, device_seconds, slot_seconds, wasted_seconds,
                                 attempts)
    VALUES (NEW.user_id, date_trunc('hour', now(), 'UTC'), NEW.model_id, NEW.end_user,
            NEW.device_seconds - OLD.device_seconds, NEW.slot_seconds - OLD.slot_seconds,
            NEW.wasted_seconds - OLD.wasted_seconds, 1)
    ON CONFLICT (tenant_id, hour, model_id, end_user) DO UPDATE
        SET device_seconds = u.device_seconds + EXCLUDED.device_seconds,
            slot_seconds = u.slot_seconds + EXCLUDED.slot_seconds,
            wasted_seconds = u.wasted_seconds + EXCLUDED.wasted_seconds, attempts = u.attempts + 1;
    RETURN NULL;
END $$;

-- Only statements that set the metered columns fire it, and only rows whose figures changed call it.
CREATE OR REPLACE TRIGGER task_usage_on_update AFTER UPDATE OF device_seconds, slot_seconds, wasted_seconds ON task
    FOR EACH ROW WHEN (NEW.device_seconds <> OLD.device_seconds OR NEW.slot_seconds <> OLD.slot_seconds
                       OR NEW.wasted_seconds <> OLD.wasted_seconds)
    EXECUTE FUNCTION task_record_usage();

-- Tokens: a chat task's input and output tokens, added to its tenant's, model's, end user's and hour's row when
-- its answer is recorded (the succeeding attempt's counts; the seconds above count every attempt).
CREATE OR REPLACE FUNCTION task_record_tokens() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO usage_hour AS u (tenant_id, hour, model_id, end_user, input_tokens, output_tokens)
    VALUES (NEW.user_id, date_trunc('hour', now(), 'UTC'), NEW.model_id, NEW.end_user,
            NEW.input_tokens - OLD.input_tokens, NEW.output_tokens - OLD.output_tokens)
    ON CONFLICT (tenant_id, hour, model_id, end_user) DO UPDATE
        SET input_tokens = u.input_tokens + EXCLUDED.input_tokens, output_tokens = u.output_tokens + EXCLUDED.output_tokens;
    RETURN NULL;
END $$;

CREATE OR REPLACE TRIGGER task_tokens_on_update AFTER UPDATE OF input_tokens, output_tokens ON task
    FOR EACH ROW WHEN (NEW.input_tokens <> OLD.input_tokens OR NEW.output_tokens <> OLD.output_tokens)
    EXECUTE FUNCTION task_record_tokens();

-- Budgets: a task admitted under its tenant's GPU-second budget reserved its estimate on its admission day; when it
-- ends (finished, failed, timed out, cancelled), the charge is settled to what its attempts measured (a task
-- cancelled before it ran releases its whole reservation). A chat task admitted under a token budget reserved its
-- max_output_tokens and counted input; its charge is settled to the tokens its row records as it ends (input and
-- output of the succeeding attempt: a failed or cancelled task releases its reservation).
CREATE OR REPLACE FUNCTION task_settle_budget() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.budget_day IS NOT NULL THEN
        UPDATE budget_charge SET seconds = seconds + NEW.device_seconds - NEW.gpu_reserved
        WHERE tenant_id = NEW.user_id AND day = NEW.budget_day;
    END IF;
    IF NEW.token_budget_day IS NOT NULL THEN
        UPDATE budget_charge SET tokens = tokens + NEW.input_tokens + NEW.output_tokens - NEW.tokens_reserved
        WHERE tenant_id = NEW.user_id AND day = NEW.token_budget_day;
    END IF;
    RETURN NULL;
END $$;

CREATE OR REPLACE TRIGGER task_budget_on_end AFTER UPDATE OF status ON task
    FOR EACH ROW WHEN ((NEW.budget_day IS NOT NULL OR NEW.token_budget_day IS NOT NULL)
                       AND NEW.status IN ('SUCCEEDED', 'FAILED', 'TIMEOUT', 'CANCELED')
                       AND OLD.status NOT IN ('SUCCEEDED', 'FAILED', 'TIMEOUT', 'CANCELED'))
    EXECUTE FUNCTION task_settle_budget();
