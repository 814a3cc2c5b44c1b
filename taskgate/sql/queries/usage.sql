-- Metering: what tasks' attempts used, summed per tenant, model and hour (functions/usage.sql writes the sums).

-- name: usage_rows
-- Metered seconds (and chat tokens) per tenant and model, per hour with $4, per end user with $6, over the hours from $2's (rounded
-- down) to before $3; $1 one tenant (NULL: every one); $7 one end user ('' the tenant's own tasks; NULL: every one);
-- $5 most rows.
SELECT u.tenant_id, u.model_id, CASE WHEN $4::boolean THEN u.hour END AS hour,
       CASE WHEN $6::boolean THEN u.end_user END AS end_user,
       sum(u.device_seconds)::float8 AS device_seconds, sum(u.slot_seconds)::float8 AS slot_seconds,
       sum(u.attempts)::bigint AS attempts, sum(u.input_tokens)::bigint AS input_tokens,
       sum(u.output_tokens)::bigint AS output_tokens
FROM usage_hour u
WHERE ($1::text IS NULL OR u.tenant_id = $1) AND u.hour >= date_trunc('hour', $2::timestamptz, 'UTC') AND u.hour < $3
  AND ($7::text IS NULL OR u.end_user = $7)
GROUP BY 1, 2, 3, 4
ORDER BY 1, 4, 2, 3
LIMIT $5;
