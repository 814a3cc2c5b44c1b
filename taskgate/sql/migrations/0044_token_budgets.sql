-- Token budgets at admission (#34), beside the GPU-second ones (0027): a tenant's chat tokens per UTC day and per UTC
-- month (NULL: none). A chat task reserves its max_output_tokens plus its input as the gateway counted it when it is
-- admitted (token_estimate of its admission_item), charged to budget_charge.tokens on its admission day
-- (token_budget_day); when it ends the charge is settled to the tokens its row records (input + output: a failed or
-- cancelled task releases what it reserved; functions/usage.sql).
ALTER TABLE tenant ADD COLUMN tokens_per_day bigint CHECK (tokens_per_day > 0),
                   ADD COLUMN tokens_per_month bigint CHECK (tokens_per_month > 0);

ALTER TABLE task ADD COLUMN tokens_reserved bigint NOT NULL DEFAULT 0 CHECK (tokens_reserved >= 0),
                 ADD COLUMN token_budget_day date;  -- NULL: its tenant had no token budget when it was admitted

ALTER TABLE budget_charge ADD COLUMN tokens bigint NOT NULL DEFAULT 0;

-- The submission's tokens to reserve (NULL: not a chat task, none).
ALTER TYPE admission_item ADD ATTRIBUTE token_estimate bigint;

-- insert_tasks takes each task's token reservation and submit_tasks answers a token budget's refusal: new signatures.
DROP FUNCTION IF EXISTS submit_tasks(jsonb, integer, float8, integer, timestamptz, integer, integer);
DROP FUNCTION IF EXISTS insert_tasks(bigint[], text[], text[], boolean[], text[], text[], text[], text[], jsonb[], jsonb[],
                                     smallint[], text[], integer[], text[], text[], jsonb[], timestamptz[], float8[],
                                     boolean[], bigint[], float8[], date[], text[]);
