"""The caller's trace context as gRPC metadata: sent only when OpenTelemetry is installed and a span is current.

The SDK never requires OpenTelemetry; with it, a task's trace on the server continues the span the caller had open.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, MutableMapping


@functools.cache
def _injector() -> Callable[[MutableMapping[str, str]], None] | None:
    try:
        from opentelemetry import propagate
    except ImportError:
        return None
    return propagate.inject


def metadata() -> tuple[tuple[str, str], ...]:
    """`traceparent` (and `tracestate`) of the current span; empty without OpenTelemetry or a current span."""
    inject = _injector()
    if inject is None:
        return ()
    carrier: dict[str, str] = {}
    inject(carrier)
    return tuple(carrier.items())
