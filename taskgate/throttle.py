"""Per-tenant limits on calls and open streams, per process: one tenant's traffic cannot crowd out another's.

Every authenticated RPC takes a token from its tenant's bucket (token_bucket: `tenant_calls_per_second`, bursts of
`tenant_calls_burst`); an empty bucket answers RESOURCE_EXHAUSTED with RetryInfo (the time one token takes to come
back). Streams hold a place for their whole life, capped per tenant and per process. The limits are per process, so a
tenant's ceiling over the fleet is the limit times the replicas behind the load balancer; the submission rate and the
pending limit stay exact across replicas (they are counted in PostgreSQL).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

import token_bucket

from taskgate import errors, telemetry
from taskgate.config import Settings
from taskgate_api import reasons


class Throttle:
    """One process's token buckets (per tenant) and open-stream counts (per tenant and in all)."""

    def __init__(
        self, *, calls_per_second: float, calls_burst: int, streams_per_tenant: int, streams_per_process: int
    ) -> None:
        self._rate = calls_per_second
        self._calls = (
            token_bucket.Limiter(calls_per_second, calls_burst, token_bucket.MemoryStorage()) if calls_per_second > 0 else None
        )
        self._per_tenant = streams_per_tenant
        self._per_process = streams_per_process
        self._streams: Counter[str] = Counter()

    @classmethod
    def of(cls, settings: Settings) -> Throttle:
        """The limits `settings` name."""
        return cls(
            calls_per_second=settings.tenant_calls_per_second, calls_burst=settings.tenant_calls_burst,
            streams_per_tenant=settings.max_streams_per_tenant, streams_per_process=settings.max_streams_per_process,
        )

    def call(self, tenant: str, service: str) -> None:
        """Takes one call's token from `tenant`'s bucket, or refuses the call."""
        if self._calls is not None and not self._calls.consume(tenant):
            telemetry.THROTTLED.labels(service, "calls").inc()
            raise errors.resource_exhausted(
                reasons.TENANT_RATE_LIMITED, f"more than {self._rate:g} calls per second from this tenant; slow down",
                retry_after=1.0 / self._rate,
            )

    @contextlib.contextmanager
    def stream(self, tenant: str, service: str) -> Iterator[None]:
        """Holds one of `tenant`'s stream places while the block runs, or refuses the stream."""
        if self._streams[tenant] >= self._per_tenant or self._streams.total() >= self._per_process:
            telemetry.THROTTLED.labels(service, "streams").inc()
            whose = "this tenant's" if self._streams[tenant] >= self._per_tenant else "this server's"
            raise errors.resource_exhausted(
                reasons.TOO_MANY_STREAMS, f"{whose} open streams are at their limit; close one or retry later", retry_after=1.0
            )
        self._streams[tenant] += 1
        try:
            yield
        finally:
            self._streams[tenant] -= 1
            if not self._streams[tenant]:
                del self._streams[tenant]
