"""The test suite: unit/, integration/<service>/, system/, and support/ (what they share); conftest.py has the session's
fixtures."""

import taskgate_local  # noqa: F401  (gRPC fork handlers off before grpc loads: see taskgate_local/__init__.py)
