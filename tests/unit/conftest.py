"""Unit tests run without servers: the session's PostgreSQL and NATS are refused here, and `settings` needs neither."""

from __future__ import annotations

from pathlib import Path

import pytest

from taskgate.config import Settings
from tests.support.factories import settings_for


@pytest.fixture(scope="session")
def servers() -> None:
    """Replaces the session's servers: a unit test that reaches for PostgreSQL or NATS belongs in tests/integration/."""
    pytest.fail(
        "a unit test asked for PostgreSQL/NATS (through database_url, nats_url, backends, ...): move it to "
        "tests/integration/"
    )


@pytest.fixture(scope="session")
def s3_server() -> None:
    pytest.fail("a unit test asked for the S3 server: move it to tests/integration/")


@pytest.fixture
def backends() -> None:
    pytest.fail("a unit test asked for connected backends: move it to tests/integration/")


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    """The integration tests' settings without a database or NATS URL (nothing here connects)."""
    return settings_for(tmp_path)
