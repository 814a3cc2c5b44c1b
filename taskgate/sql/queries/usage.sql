-- Metering: what tasks' attempts used, summed per tenant, model and hour (functions/usage.sql writes the sums).

-- name: usage_rows
-- Metered seconds per tenant and model, per hour with $4, over the hours from $2's (rounded down) to before $3; $1
-- one tenant (NULL: every one); $5 most rows.
SELECT u.tenant_id, u.model_id, CASE WHEN $4::boolean THEN u.hour END AS hour,
       sum(u.device_seconds)::float8 AS device_seconds, sum(u.slot_seconds)::float8 AS slot_seconds,
       sum(u.attempts)::bigint AS attempts
FROM usage_hour u
WHERE ($1::text IS NULL OR u.tenant_id = $1) AND u.hour >= date_trunc('hour', $2::timestamptz, 'UTC') AND u.hour < $3
GROUP BY 1, 2, 3
ORDER BY 1, 2, 3
LIMIT $5;
