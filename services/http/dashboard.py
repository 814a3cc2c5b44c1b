"""The operator dashboard at /dashboard (being written: see the HTTP issue)."""

from __future__ import annotations

from starlette.routing import BaseRoute

from taskgate.config import Settings

from .upstream import Upstream


def routes(upstream: Upstream, settings: Settings) -> list[BaseRoute]:
    """The dashboard's routes over the upstream channels."""
    return []
