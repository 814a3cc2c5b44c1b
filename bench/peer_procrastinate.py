"""The procrastinate app the peer benchmark runs, with the documented periodic retry of stalled jobs."""

from __future__ import annotations

import asyncio
import os
import time

import procrastinate

app = procrastinate.App(
    connector=procrastinate.PsycopgConnector(
        conninfo=os.environ.get("BENCH_PROCRASTINATE_DSN", ""), min_size=1, max_size=16
    )
)

START_TABLE = "CREATE TABLE IF NOT EXISTS bench_peer_start (token text NOT NULL, at float8 NOT NULL)"


async def _started(token: str) -> None:
    at = time.time()
    await app.connector.execute_query_async(
        "INSERT INTO bench_peer_start (token, at) VALUES (%(token)s, %(at)s)", token=token, at=at
    )


@app.task(name="noop")
async def noop(token: str) -> None:
    """A no-op that records when its body started."""
    await _started(token)


@app.task(name="hold")
async def hold(token: str, seconds: float) -> None:
    """Records each start of its body, then holds the worker."""
    await _started(token)
    await asyncio.sleep(seconds)


@app.periodic(cron="* * * * * *")
@app.task(name="retry_stalled", queueing_lock="retry_stalled")
async def retry_stalled(timestamp: int) -> None:
    """procrastinate's recipe for jobs of dead workers: retry what a worker without heartbeats held."""
    for job in await app.job_manager.get_stalled_jobs():
        await app.job_manager.retry_job(job)
