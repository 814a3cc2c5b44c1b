"""Per-tenant limits on calls and open streams, per process: one tenant's traffic cannot crowd out another's.

Every authenticated RPC is paced by its tenant's rate (`Pace`: `tenant_calls_per_second`, bursts of
`tenant_calls_burst`): a call past it waits for its tenant's next free moment, up to `tenant_calls_wait_seconds`;
further off, it is refused RESOURCE_EXHAUSTED with RetryInfo (when that moment comes). A unary call then takes a
place among the calls the process runs at once (`Places`): at most `tenant_calls_in_flight` of one tenant and
`process_calls_in_flight` in all; the rest wait, each tenant's in its own line, and a freed place goes to the waiting
tenants in turn — so a tenant's calls wait behind its own, never in front of another's. Streams hold a place of
their own for their whole life, capped per tenant and per process. The limits are per process, so a tenant's ceiling
over the fleet is the limit times the replicas behind the load balancer; the submission rate and the pending limit stay
exact across replicas (they are counted in PostgreSQL).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator

from taskgate import errors, telemetry
from taskgate.config import CommonSettings
from taskgate_api import reasons

# The place a unary call holds, set around the call by call_scope: None outside one (streams take none), [] in a call
# that has not taken a place yet, [release] once it has.
_held: contextvars.ContextVar[list[Callable[[], None]] | None] = contextvars.ContextVar(
    "taskgate_call_place", default=None
)


@contextlib.contextmanager
def call_scope() -> Iterator[None]:
    """Around one unary call: the place it takes once its tenant is known (Throttle.call) is given back at its end."""
    held: list[Callable[[], None]] = []
    token = _held.set(held)
    try:
        yield
    finally:
        for release in held:
            release()
        # a call the client cancelled ends in another context, where the token is foreign
        with contextlib.suppress(ValueError):
            _held.reset(token)


class Places:
    """The calls one process runs at once: at most `per_tenant` of a tenant and `per_process` in all (0 = no cap).
    A call over either waits in its tenant's line (at most `waiting_per_tenant`, then refused); a freed place goes to
    the next waiting tenant in turn that is under its own cap (round robin), the tenant's oldest call first."""

    def __init__(self, *, per_tenant: int, per_process: int, waiting_per_tenant: int) -> None:
        self._per_tenant = per_tenant
        self._per_process = per_process
        self._waiting_cap = waiting_per_tenant
        self._running: Counter[str] = Counter()
        self._total = 0
        # the tenants with waiting calls, in their turn's order
        self._lines: dict[str, deque[asyncio.Future[None]]] = {}

    @property
    def running(self) -> int:
        """Calls holding a place now."""
        return self._total

    def waiting(self, tenant: str) -> int:
        """`tenant`'s calls waiting for a place."""
        return len(self._lines.get(tenant, ()))

    def _free_for(self, tenant: str) -> bool:
        return (not self._per_tenant or self._running[tenant] < self._per_tenant) and (
            not self._per_process or self._total < self._per_process
        )

    def _take(self, tenant: str) -> None:
        self._running[tenant] += 1
        self._total += 1

    async def enter(self, tenant: str) -> None:
        """Takes a place for one of `tenant`'s calls, waiting in its line while its tenant or the process is full."""
        if tenant not in self._lines and self._free_for(tenant):
            self._take(tenant)
            return
        line = self._lines.setdefault(tenant, deque())
        if len(line) >= self._waiting_cap:
            raise errors.resource_exhausted(
                reasons.TENANT_RATE_LIMITED,
                f"more than {self._waiting_cap} calls from this tenant are waiting on this server; slow down",
                retry_after=1.0,
            )
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        line.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.leave(tenant)  # granted as the call was cancelled: the place goes on
            else:
                self._drop(tenant, waiter)
            raise

    def _drop(self, tenant: str, waiter: asyncio.Future[None]) -> None:
        line = self._lines.get(tenant)
        if line is None:
            return
        with contextlib.suppress(ValueError):
            line.remove(waiter)
        if not line:
            del self._lines[tenant]

    def leave(self, tenant: str) -> None:
        """Gives one of `tenant`'s places back and hands the free places to the waiting tenants in turn."""
        self._running[tenant] -= 1
        if not self._running[tenant]:
            del self._running[tenant]
        self._total -= 1
        while self._lines and (not self._per_process or self._total < self._per_process):
            granted = False
            for name in list(self._lines):
                if not self._free_for(name):
                    continue
                line = self._lines.pop(name)
                line.popleft().set_result(None)
                self._take(name)
                if line:
                    self._lines[name] = line  # to the end of the turn
                granted = True
                break
            if not granted:
                return


class Pace:
    """Per-tenant call rates as a schedule (GCRA, the token bucket's equivalent): `rate` calls a second, `burst` of them
    at once; a call past them is given the next free moment of its tenant and waits for it, up to `max_wait` seconds;
    one that would wait longer is refused, told when its moment would have come. Waiting calls hold nothing but a
    timer, so a tenant at its rate slows only its own calls, and a client that retries at once is not spinning."""

    ENTRIES = 10_000  # tenants remembered; past it the ones whose schedule is behind them are forgotten

    def __init__(self, rate: float, burst: int, max_wait: float) -> None:
        self._interval = 1.0 / rate
        self._tolerance = (burst - 1) * self._interval
        self._max_wait = max_wait
        self._due: dict[str, float] = {}  # tenant -> the moment its calls so far have used the rate up to

    def wait(self, tenant: str, now: float | None = None) -> float:
        """Seconds a call of `tenant` must wait for its moment (0: at once), counted as made; `Late` (with those
        seconds) when they are more than max_wait, not counted."""
        now = time.monotonic() if now is None else now
        due = max(self._due.get(tenant, now), now)
        delay = max(0.0, due - self._tolerance - now)
        if delay > self._max_wait:
            raise Late(delay)
        if len(self._due) >= self.ENTRIES:
            self._due = {t: d for t, d in self._due.items() if d > now}
        self._due[tenant] = due + self._interval
        return delay


class Late(Exception):
    """A call whose moment under its tenant's rate is further off than a call may wait."""

    def __init__(self, seconds: float) -> None:
        super().__init__(seconds)
        self.seconds = seconds


class Throttle:
    """One process's call rates (per tenant), call places (per tenant and in all) and open-stream counts."""

    def __init__(
        self, *, calls_per_second: float, calls_burst: int, streams_per_tenant: int, streams_per_process: int,
        calls_wait_seconds: float = 0.0, calls_in_flight_per_tenant: int = 0, calls_in_flight_per_process: int = 0,
        calls_waiting_per_tenant: int = 1000,
    ) -> None:
        self._rate = calls_per_second
        self._pace = Pace(calls_per_second, calls_burst, calls_wait_seconds) if calls_per_second > 0 else None
        self.places = Places(
            per_tenant=calls_in_flight_per_tenant, per_process=calls_in_flight_per_process,
            waiting_per_tenant=calls_waiting_per_tenant,
        )
        self._per_tenant = streams_per_tenant
        self._per_process = streams_per_process
        self._streams: Counter[str] = Counter()

    @classmethod
    def of(cls, settings: CommonSettings) -> Throttle:
        """The limits `settings` name."""
        return cls(
            calls_per_second=settings.tenant_calls_per_second, calls_burst=settings.tenant_calls_burst,
            streams_per_tenant=settings.max_streams_per_tenant, streams_per_process=settings.max_streams_per_process,
            calls_wait_seconds=settings.tenant_calls_wait_seconds,
            calls_in_flight_per_tenant=settings.tenant_calls_in_flight,
            calls_in_flight_per_process=settings.process_calls_in_flight,
            calls_waiting_per_tenant=settings.tenant_calls_waiting,
        )

    async def call(self, tenant: str, service: str) -> None:
        """Waits for one call's moment under `tenant`'s rate, or refuses the call; inside a unary call (call_scope)
        then takes its place among the calls running, waiting for it in `tenant`'s line."""
        if self._pace is not None:
            try:
                delay = self._pace.wait(tenant)
            except Late as late:
                telemetry.THROTTLED.labels(service, "calls").inc()
                raise errors.resource_exhausted(
                    reasons.TENANT_RATE_LIMITED,
                    f"more than {self._rate:g} calls per second from this tenant; slow down",
                    retry_after=late.seconds,
                ) from None
            if delay:
                await asyncio.sleep(delay)
        held = _held.get()
        if held is None or held:
            return  # a stream (its own caps), or the call holds its place already
        try:
            await self.places.enter(tenant)
        except errors.ApiError:
            telemetry.THROTTLED.labels(service, "waiting").inc()
            raise
        places = self.places
        held.append(lambda: places.leave(tenant))

    @contextlib.contextmanager
    def stream(self, tenant: str, service: str) -> Iterator[None]:
        """Holds one of `tenant`'s stream places while the block runs, or refuses the stream."""
        self.open_stream(tenant, service)
        try:
            yield
        finally:
            self.close_stream(tenant)

    def open_stream(self, tenant: str, service: str) -> None:
        """Takes one of `tenant`'s stream places, or refuses the stream; each is given back by one close_stream (what
        `stream` does around a block: a stream held by 10,000s takes it without a context manager of its own)."""
        if self._streams[tenant] >= self._per_tenant or self._streams.total() >= self._per_process:
            telemetry.THROTTLED.labels(service, "streams").inc()
            whose = "this tenant's" if self._streams[tenant] >= self._per_tenant else "this server's"
            raise errors.resource_exhausted(
                reasons.TOO_MANY_STREAMS,
                f"{whose} open streams are at their limit; close one or retry later",
                retry_after=1.0,
            )
        self._streams[tenant] += 1

    def close_stream(self, tenant: str) -> None:
        """Gives back a stream place open_stream took."""
        self._streams[tenant] -= 1
        if not self._streams[tenant]:
            del self._streams[tenant]
