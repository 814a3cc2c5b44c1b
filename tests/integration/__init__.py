"""Each service (and the client, the stores, security, observability) against real PostgreSQL, NATS and gRPC."""
