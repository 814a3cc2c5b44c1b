-- Metering: what tasks' attempts used, summed per tenant, model and hour (functions/usage.sql writes the sums).

-- name: usage_rows
-- Metered seconds (and chat tokens) per tenant and model, per hour with @by_hour, per end user with @by_end_user,
-- over the hours from @since's (rounded down) to before @until; @tenant_id one tenant (NULL: every one); @end_user
-- one end user ('' the tenant's own tasks; NULL: every one); @limit most rows.
SELECT u.tenant_id, u.model_id, CASE WHEN @by_hour::boolean THEN u.hour END AS hour,
       CASE WHEN @by_end_user::boolean THEN u.end_user END AS end_user,
       sum(u.device_seconds)::float8 AS device_seconds, sum(u.slot_seconds)::float8 AS slot_seconds,
       sum(u.attempts)::bigint AS attempts, sum(u.input_tokens)::bigint AS input_tokens,
       sum(u.output_tokens)::bigint AS output_tokens
FROM usage_hour u
WHERE (@tenant_id::text IS NULL OR u.tenant_id = @tenant_id) AND u.hour >= date_trunc('hour', @since::timestamptz, 'UTC') AND u.hour < @until
  AND (@end_user::text IS NULL OR u.end_user = @end_user)
GROUP BY 1, 2, 3, 4
ORDER BY 1, 4, 2, 3
LIMIT @limit;
