"""Tests without servers: pure rules, run by `make test-unit` in seconds (conftest.py refuses PostgreSQL and NATS)."""
