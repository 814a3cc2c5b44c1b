"""`make bench`: taskgate's figures measured on the embedded stack, printed as a table and written as JSON.

Every run starts its own embedded PostgreSQL and NATS and the services as processes (tests.support.harness.Cluster),
with a 'sleep' model so the gateway itself is measured, not a GPU. There are no pass/fail thresholds: each figure is
shown beside the target of issue 9 and marked MISSED where it misses.
"""

import taskgate_local  # noqa: F401  (gRPC fork handlers off before grpc loads: see taskgate_local/__init__.py)
