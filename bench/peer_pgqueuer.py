"""The PgQueuer worker the peer benchmark runs: `python -m bench.peer_pgqueuer BATCH HEARTBEAT_SECONDS`.

It runs `pgqueuer.run(create, ...)`, what `pgq run bench.peer_pgqueuer:create` runs (PgQueuer 1.6.0's CLI itself fails
at start with the pinned typer, on its --log-level default: "'str' object has no attribute 'name'").

One asyncpg connection for PgQueuer's QueueManager (its LISTEN/NOTIFY wake-up, dequeue with FOR UPDATE SKIP LOCKED,
buffered status log), as `pgq run` sets it up; a small pool of its own for the bodies' start records. A job that
stops heart-beating (its worker died) is picked again once `--heartbeat-timeout` (PgQueuer's default, 30 s) passes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from collections.abc import AsyncIterator
from datetime import timedelta

import asyncpg
import pgqueuer
from pgqueuer import Job, Queries, QueueManager
from pgqueuer.db import AsyncpgDriver

DSN_VAR = "BENCH_PGQUEUER_DSN"
START_TABLE = "CREATE TABLE IF NOT EXISTS bench_peer_start (token text NOT NULL, at float8 NOT NULL)"
QUEUE_TABLE = "pgqueuer"  # PgQueuer's default table names
HOLD_SECONDS = 600.0


@contextlib.asynccontextmanager
async def create() -> AsyncIterator[QueueManager]:
    """The factory `pgq run` calls: a QueueManager with the bench's two entrypoints (payload: the job's token)."""
    dsn = os.environ[DSN_VAR]
    connection = await asyncpg.connect(dsn)
    starts = await asyncpg.create_pool(dsn, min_size=1, max_size=4)
    manager = QueueManager(Queries(AsyncpgDriver(connection)))

    async def started(job: Job) -> None:
        at = time.time()
        token = (job.payload or b"").decode()
        await starts.execute("INSERT INTO bench_peer_start (token, at) VALUES ($1, $2)", token, at)

    @manager.entrypoint("noop")
    async def noop(job: Job) -> None:
        """A no-op that records when its body started."""
        await started(job)

    @manager.entrypoint("hold")
    async def hold(job: Job) -> None:
        """Records each start of its body, then holds the worker."""
        await started(job)
        await asyncio.sleep(HOLD_SECONDS)

    try:
        yield manager
    finally:
        await starts.close()
        await connection.close()


def main(argv: list[str]) -> None:
    """Runs the worker until SIGTERM/SIGINT: `batch` jobs per dequeue (at most twice that running, PgQueuer's least),
    jobs re-picked after `heartbeat` seconds without a heartbeat."""
    batch, heartbeat = int(argv[0]), float(argv[1])
    asyncio.run(pgqueuer.run(create, batch_size=batch, max_concurrent_tasks=2 * batch,
                             heartbeat_timeout=timedelta(seconds=heartbeat)))


if __name__ == "__main__":
    main(sys.argv[1:])
