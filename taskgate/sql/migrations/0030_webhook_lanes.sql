-- Webhooks fair per destination (#22): each delivery names its destination (scheme://host:port of its URL), which
-- the sender caps in flight and guards with one circuit breaker shared by every notifier replica.
CREATE FUNCTION webhook_destination_of(url text) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT lower(substring(url FROM '^[A-Za-z][A-Za-z0-9+.-]*://[^/?#]+'));
$$;

ALTER TABLE callback_delivery ADD COLUMN destination text GENERATED ALWAYS AS (webhook_destination_of(url)) STORED;

-- Deliveries in flight (leased), per destination: the per-destination cap counts them.
CREATE INDEX callback_delivery_leased_idx ON callback_delivery (destination) WHERE lease_owner IS NOT NULL;

CREATE TABLE webhook_destination (
    destination text PRIMARY KEY,
    failures    integer NOT NULL DEFAULT 0 CHECK (failures >= 0),  -- consecutive attempts that failed (5xx, timeout, no answer)
    open_until  timestamptz                                         -- the breaker is open until then: no attempts
);
