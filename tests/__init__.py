"""The test suite (tests/conftest.py has the fixtures)."""

import taskgate_local  # noqa: F401  (gRPC fork handlers off before grpc loads: see taskgate_local/__init__.py)
