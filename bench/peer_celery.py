"""The Celery app the peer benchmark runs: Redis broker and result backend, late acks, prefetch 1."""

from __future__ import annotations

import os
import time

import redis
from celery import Celery

URL = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")

app = Celery("bench", broker=URL, backend=URL)
app.conf.update(
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    result_expires=3600,
)


@app.task(name="bench.noop")
def noop(token: str) -> float:
    """A no-op: returns when its body started."""
    return time.time()


@app.task(name="bench.hold")
def hold(token: str, seconds: float) -> None:
    """Records each start of its body, then holds the worker."""
    redis.Redis.from_url(URL).rpush(f"starts:{token}", time.time())
    time.sleep(seconds)
