-- What a service's readiness probe asks PostgreSQL (taskgate/server.py Health).

-- name: health_ping
-- One round trip that needs a working connection and a server accepting queries.
SELECT 1;
