"""What every service process does around its own work: settings, logs, backends, signals, shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import signal
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import asyncpg
import tenacity
from nats.errors import Error as NatsError

from taskgate import bus as busmod
from taskgate import telemetry, tracing
from taskgate.config import CommonSettings, S, load_settings
from taskgate.migrate import migrate
from taskgate.stackfile import local_stack_urls
from taskgate.store import create_pool

log = logging.getLogger("taskgate.runtime")
T = TypeVar("T")
STOP_TASKS_SECONDS = 5.0


async def stop_tasks(tasks: Iterable[asyncio.Task[Any]], within: float = STOP_TASKS_SECONDS) -> None:
    """Cancels background loops and waits for them, never longer than `within`.

    Some client libraries turn a cancellation into an error of their own (nats-py's publish_async does), and a loop
    that handles that error carries on: shutdown must not wait for it forever. A loop left running is logged.
    """
    pending = [task for task in tasks if not task.done()]
    for task in pending:
        task.cancel()
    if not pending:
        return
    done, stuck = await asyncio.wait(pending, timeout=within)
    for task in done:
        if not task.cancelled():
            task.exception()  # retrieved: a loop that died of an error logged it itself
    for task in stuck:
        log.error("background task did not stop when cancelled", extra={"task": task.get_name()})


@dataclass
class Backends:
    """A service's connections to PostgreSQL and NATS."""

    settings: CommonSettings
    pool: asyncpg.Pool
    bus: busmod.Bus
    database_url: str
    nats_url: str

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.bus.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.pool.close(), 5)


def resolve_urls(settings: CommonSettings) -> tuple[str, str]:
    """Configured URLs win; else a running embedded stack under state_dir; else an error saying what to do."""
    if settings.database_url and settings.nats_url:
        return settings.database_url, settings.nats_url
    running = local_stack_urls(settings.state_dir)
    if running is None:
        raise SystemExit(
            "taskgate: no TASKGATE_DATABASE_URL/TASKGATE_NATS_URL and no embedded stack running under "
            f"{settings.state_dir} (start one with `python -m taskgate_local.stack`)"
        )
    return settings.database_url or running[0], settings.nats_url or running[1]


# what a backend that is not up yet raises on a first connection
STARTUP_ERRORS: tuple[type[BaseException], ...] = (
    OSError, asyncio.TimeoutError, asyncpg.PostgresConnectionError, asyncpg.CannotConnectNowError, NatsError,
)


async def _first(what: str, settings: CommonSettings, connecting: Callable[[], Awaitable[T]]) -> T:
    """`connecting` (a coroutine function), retried with backoff (0.5 s doubling to 10 s) for startup_connect_seconds,
    a log line per failure."""

    def failed(state: tenacity.RetryCallState) -> None:
        error = state.outcome.exception() if state.outcome else None
        log.warning(f"{what} not reachable yet; retrying", extra={
            "attempt": state.attempt_number, "error": repr(error), "retry_in_seconds": round(state.upcoming_sleep, 2)})

    retrying = tenacity.AsyncRetrying(
        retry=tenacity.retry_if_exception_type(STARTUP_ERRORS),
        wait=tenacity.wait_exponential(multiplier=0.5, max=10),
        stop=tenacity.stop_after_delay(settings.startup_connect_seconds),
        before_sleep=failed,
        reraise=True,
    )
    return await retrying(connecting)


async def connect(settings: CommonSettings, name: str, *, setup: bool | None = None) -> Backends:
    """Connects to both backends (each first connection retried, see _first); with `setup` (default:
    settings.setup_on_start), applies migrations and declares streams (idempotent)."""
    setup = settings.setup_on_start if setup is None else setup
    database_url, nats_url = resolve_urls(settings)
    pool = await _first("PostgreSQL", settings, functools.partial(create_pool, database_url, settings.db_pool_size))
    try:
        if setup:
            async with pool.acquire() as conn:
                await migrate(conn)
        bus = await _first(
            "NATS", settings, functools.partial(busmod.connect, nats_url, name, tls_ca_file=settings.nats_tls_ca_file)
        )
    except BaseException:
        await pool.close()
        raise
    if setup:
        await busmod.declare(bus, settings)
    return Backends(settings, pool, bus, database_url, nats_url)


@contextlib.asynccontextmanager
async def stop_signal() -> AsyncIterator[asyncio.Event]:
    """An event set on SIGTERM or SIGINT."""
    loop = asyncio.get_running_loop()
    event = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, event.set)
    try:
        yield event
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


class Stoppable(Protocol):
    """A started service: what `serve_until_signal` stops."""

    async def stop(self) -> None: ...


async def serve_until_signal(start: Callable[[], Awaitable[Stoppable]], *, grace_seconds: float) -> None:
    """Starts a service, runs it until SIGTERM or SIGINT, then stops it (in-flight work gets `grace_seconds`)."""
    async with stop_signal() as stop:
        handle = await start()
        await stop.wait()
    log.info("stopping", extra={"grace_seconds": grace_seconds})
    await handle.stop()


def run_service(
    name: str, group: type[S], main: Callable[[S], Coroutine[None, None, None]], metrics_port: Callable[[S], int]
) -> None:
    """Entry point of `python -m services.<name>`: reads the service's own settings group (and no other), sets up logs,
    /metrics and tracing, runs `main`."""
    settings = load_settings(group)
    telemetry.configure_logging(name, settings.log_level)
    telemetry.serve_metrics(metrics_port(settings), settings.metrics_host)
    tracing.configure(name)  # before any server or connection exists: the instrumentations wrap them
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(main(settings))
    log.info("stopped", extra={"service": name})
