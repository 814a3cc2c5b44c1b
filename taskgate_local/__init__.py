"""Local-stack tooling: `make run`, embedded PostgreSQL + NATS, the tiny model, the settings table (never imported by production code)."""
