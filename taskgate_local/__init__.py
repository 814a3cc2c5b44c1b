"""Local-stack tooling: `make run`, embedded PostgreSQL + NATS, the tiny model, the settings table (never imported by
production code)."""

import os

# The processes this tooling runs (make run, the tests, the bench) fork only to exec: the embedded servers, the
# services. gRPC's fork handlers are for children that go on using gRPC, and its post-fork child handler can crash a
# child before it execs (seen: pg_ctl died with SIGSEGV when the fault suite restarted PostgreSQL), so they are off
# here, as gRPC's fork_support.md advises for fork+exec. It must be set before grpc is first imported.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
