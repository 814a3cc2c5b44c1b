"""A worker's beat against real PostgreSQL and NATS: one statement renews every running attempt (and the registry
row) and carries their due progress; each task's progress is written at most once per progress_interval_seconds."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
from nats.js.manager import JetStreamManager

from services.worker import lease
from services.worker.engine import RunReport
from taskgate import store
from taskgate.config import Settings
from taskgate.runtime import Backends
from taskgate.states import Status
from taskgate.store import workers as registry
from tests.support.factories import claimed, params, sleepy_settings, submit, with_
from tests.support.harness import WorkerFactory as Factory
from tests.support.queries import is_status, wait_task

TOLERANCE = 0.03  # seconds: the database's now() of two statements vs the worker's clock when it sent them


@dataclass
class Beat:
    """One call of the beat statement, as the spy saw it."""

    at: float
    attempts: tuple[registry.BeatAttempt, ...]
    registered: bool
    renewed: dict[int, registry.Renewal]
    rows: list[Any] = field(default_factory=list)  # (id, xmin) of the named rows and the worker's row, read just after


class Spy:
    """Records every beat statement the worker runs; tests await the beats they need instead of sleeping."""

    def __init__(self, backends: Backends) -> None:
        self.backends = backends
        self.beats: list[Beat] = []
        self._changed = asyncio.Condition()

    async def __call__(
        self, db: store.Conn, attempts: Sequence[registry.BeatAttempt], *, lease_seconds: float,
        worker: registry.Registration | None = None, actor: str = "worker",
    ) -> dict[int, registry.Renewal]:
        renewed = await ORIGINAL(db, attempts, lease_seconds=lease_seconds, worker=worker, actor=actor)
        beat = Beat(time.monotonic(), tuple(attempts), worker is not None, renewed)
        if attempts and worker is not None:
            beat.rows = list(
                await self.backends.pool.fetch(
                    "SELECT id::text, xmin::text FROM task WHERE id = ANY($1) UNION ALL "
                    "SELECT id, xmin::text FROM worker WHERE id = $2",
                    [a.task_id for a in attempts], worker.worker_id,
                )
            )
        async with self._changed:
            self.beats.append(beat)
            self._changed.notify_all()
        return renewed

    async def wait(self, predicate: Any, count: int = 1, within: float = 10.0) -> list[Beat]:
        """The first `count` beats (from now on) that match `predicate`."""
        start = len(self.beats)
        async with asyncio.timeout(within), self._changed:
            await self._changed.wait_for(lambda: len([b for b in self.beats[start:] if predicate(b)]) >= count)
        return [b for b in self.beats[start:] if predicate(b)][:count]


ORIGINAL = registry.beat


@pytest.fixture
async def spy(backends: Backends, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Spy]:
    recorder = Spy(backends)
    monkeypatch.setattr(registry, "beat", recorder)
    yield recorder


def fleet(settings: Settings, **update: Any) -> Settings:
    """A sleep-model worker with three slots, renewing often, writing no progress (its interval is past the test)."""
    return with_(
        sleepy_settings(settings, sleep=30.0), worker_slots=3, heartbeat_seconds=0.3, lease_seconds=1.0,
        progress_interval_seconds=600.0, **update,
    )


LONG = params(steps=300)  # 0.1 s steps: a stopped run ends at the next one


def report_for(task_id: int) -> Any:
    return lambda r: r.task_id == task_id


async def test_one_statement_per_beat_renews_every_running_attempt_and_the_registry_row(
    settings: Settings, backends: Backends, workers: Factory, spy: Spy
) -> None:
    handle = await workers(fleet(settings))
    tasks = [await submit(backends, params=LONG) for _ in range(3)]
    ids = {t.id for t in tasks}
    for task in tasks:
        await wait_task(backends, task.id, is_status(Status.PROCESSING))
    full = await spy.wait(lambda b: b.registered and {a.task_id for a in b.attempts} == ids, count=3)
    for beat in full:
        # every lease in the one statement, every one renewed
        assert len(beat.attempts) == 3 and set(beat.renewed) == ids
        # 3 tasks + the worker: one transaction
        assert len({xmin for _, xmin in beat.rows}) == 1 and len(beat.rows) == 4
    # Nothing else ran between the beats: one statement per beat.
    between = [b for b in spy.beats if full[0].at <= b.at <= full[-1].at]
    assert [id(b) for b in between] == [id(b) for b in full]
    leases = await backends.pool.fetch("SELECT lease_expires_at FROM task WHERE id = ANY($1)", list(ids))
    assert len({r["lease_expires_at"] for r in leases}) == 1  # one now() for all three
    row = await backends.pool.fetchrow("SELECT running FROM worker WHERE id = $1", handle.worker_id)
    assert row is not None and row["running"] == 3
    versions = [{i: r.version for i, r in beat.renewed.items()} for beat in full]
    assert versions[0] == versions[-1]  # a renewal is no new version: no history row, nothing relayed


async def test_a_lost_lease_among_several_stops_its_run_and_the_others_keep_theirs(
    settings: Settings, backends: Backends, workers: Factory, spy: Spy
) -> None:
    handle = await workers(fleet(settings))
    tasks = [await submit(backends, params=LONG) for _ in range(3)]
    for task in tasks:
        await wait_task(backends, task.id, is_status(Status.PROCESSING))
    lost, kept = tasks[0], {t.id for t in tasks[1:]}
    # Another attempt takes the task over (as after an expired lease): this worker's next beat is refused for it.
    async with backends.pool.acquire() as conn, conn.transaction():
        assert (await store.release(conn, lost.id, actor="scheduler", expected_attempt=1, worker_lost=True)).applied
        await claimed(conn, lost.id, worker_id="elsewhere", lease_seconds=30.0)
    report: RunReport = await handle.worker.signals.reported.wait_for(report_for(lost.id), within=5)
    assert report.outcome == "lost" and report.attempt == 1
    after = await spy.wait(lambda b: b.registered and {a.task_id for a in b.attempts} == kept, count=2)
    assert all(set(b.renewed) == kept for b in after)
    row = await store.get_task(backends.pool, lost.id)
    assert row is not None and (row.status, row.attempt, row.worker_id) == (Status.PROCESSING, 2, "elsewhere")
    assert set(handle.worker.runs) == kept


async def test_progress_is_written_at_most_once_per_interval_and_its_latest_value_is_not_held_back(
    settings: Settings, backends: Backends, workers: Factory
) -> None:
    interval = 2.0
    await workers(
        with_(sleepy_settings(settings, sleep=6.0), progress_interval_seconds=interval, heartbeat_seconds=0.5)
    )
    task = await submit(backends, params=params(steps=4))  # a step every 1.5 s: 25% at 1.5 s, 50% at 3 s, 75% at 4.5 s
    row = await wait_task(backends, task.id, is_status(Status.SUCCEEDED), within=20)
    assert row.progress == 100
    history = await backends.pool.fetch(
        "SELECT * FROM task_event WHERE task_id = $1 AND to_status = 'PROCESSING' ORDER BY version", task.id
    )
    claim, *moves = history
    assert claim["progress"] == 0 and moves, "no progress written"
    times = [claim["at"], *(m["at"] for m in moves)]
    gaps = [(b - a).total_seconds() for a, b in itertools.pairwise(times)]
    assert min(gaps) >= interval - TOLERANCE, gaps
    # 25% came at 1.5 s and nothing more until 3 s: it is written when its interval is up, not with the next step.
    assert moves[0]["progress"] == 25
    assert [m["progress"] for m in moves] == sorted({m["progress"] for m in moves})


async def test_the_progress_of_all_running_tasks_goes_in_one_statement_per_interval(
    settings: Settings, backends: Backends, workers: Factory, spy: Spy
) -> None:
    interval = 0.5
    await workers(
        with_(
            sleepy_settings(settings, sleep=3.0),
            worker_slots=3,
            progress_interval_seconds=interval,
            heartbeat_seconds=1.0,
            lease_seconds=3.0,
        )
    )
    tasks = [await submit(backends, params=params(steps=30)) for _ in range(3)]
    for task in tasks:
        await wait_task(backends, task.id, is_status(Status.SUCCEEDED), within=20)
    ids = [t.id for t in tasks]
    moves = await backends.pool.fetch(
        "SELECT task_id, at, progress, xmin::text AS xid FROM task_event WHERE task_id = ANY($1) AND from_status = "
        "'PROCESSING' AND to_status = 'PROCESSING' ORDER BY task_id, version",
        ids,
    )
    by_task: dict[int, list[Any]] = {}
    for m in moves:
        by_task.setdefault(m["task_id"], []).append(m)
    assert set(by_task) == set(ids)
    for rows in by_task.values():
        gaps = [(b["at"] - a["at"]).total_seconds() for a, b in itertools.pairwise(rows)]
        assert min(gaps, default=interval) >= interval - TOLERANCE, gaps
    carrying = [b for b in spy.beats if any(a.progress is not None for a in b.attempts)]
    assert len(moves) == sum(1 for b in carrying for a in b.attempts if a.progress is not None)
    # After the first interval the three are due together: one statement writes all three (one transaction's history).
    shared: dict[str, set[int]] = {}
    for m in moves:
        shared.setdefault(m["xid"], set()).add(m["task_id"])
    assert any(len(group) == 3 for group in shared.values())
    assert len(carrying) < len(moves) / 2, (len(carrying), len(moves))
    flushes = sorted(b.at for b in carrying if not b.registered)
    assert all(b - a >= interval - TOLERANCE for a, b in itertools.pairwise(flushes))


async def test_tasks_due_together_have_their_progress_written_in_shares_spread_over_the_interval(
    settings: Settings, backends: Backends, workers: Factory, spy: Spy
) -> None:
    interval, flush = 1.2, 0.3  # four running tasks: a statement carries at most ceil(4 x 0.3 / 1.2) = 1 of them
    await workers(
        with_(
            sleepy_settings(settings, sleep=6.0),
            worker_slots=4,
            progress_interval_seconds=interval,
            progress_flush_seconds=flush,
            heartbeat_seconds=1.0,
            lease_seconds=5.0,
        )
    )
    tasks = [await submit(backends, params=params(steps=60)) for _ in range(4)]  # a step every 0.1 s, all due at once
    for task in tasks:
        await wait_task(backends, task.id, is_status(Status.SUCCEEDED), within=30)
    ids = [t.id for t in tasks]
    carrying = [b for b in spy.beats if any(a.progress is not None for a in b.attempts)]
    assert all(sum(a.progress is not None for a in b.attempts) == 1 for b in carrying), [
        [a.task_id for a in b.attempts if a.progress is not None] for b in carrying
    ]
    flushes = sorted(b.at for b in carrying)
    assert all(b - a >= flush - TOLERANCE for a, b in itertools.pairwise(flushes)), flushes
    moves = await backends.pool.fetch(
        "SELECT task_id, at, progress FROM task_event WHERE task_id = ANY($1) AND from_status = 'PROCESSING' AND "
        "to_status = 'PROCESSING' ORDER BY task_id, version",
        ids,
    )
    by_task: dict[int, list[Any]] = {}
    for m in moves:
        by_task.setdefault(m["task_id"], []).append(m)
    assert set(by_task) == set(ids) and all(len(rows) >= 2 for rows in by_task.values()), by_task
    for rows in by_task.values():  # each task still at most once per interval, its progress growing
        gaps = [(b["at"] - a["at"]).total_seconds() for a, b in itertools.pairwise(rows)]
        assert min(gaps) >= interval - TOLERANCE, gaps
        assert [r["progress"] for r in rows] == sorted({r["progress"] for r in rows})


async def test_a_beat_answers_each_renewed_attempts_version_and_logs_each_progress_move(
    backends: Backends, caplog: pytest.LogCaptureFixture
) -> None:
    task = await submit(backends, params=LONG)
    async with backends.pool.acquire() as conn:
        running = await claimed(conn, task.id, worker_id="w-beat", lease_seconds=30.0)
    caplog.set_level(logging.INFO, logger="taskgate.transition")
    renewed = await registry.beat(
        backends.pool, [registry.BeatAttempt(task.id, running.attempt, 40)], lease_seconds=30.0
    )
    row = await store.get_task(backends.pool, task.id)
    assert row is not None and (row.progress, row.version) == (40, running.version + 1)
    assert renewed == {task.id: registry.Renewal(row.version, True)}
    moves = [r for r in caplog.records if r.getMessage() == "transition"]
    assert [(m.task_id, m.version, m.attempt, m.worker, m.reason) for m in moves] == [  # type: ignore[attr-defined]
        (str(task.id), row.version, running.attempt, "w-beat", "progress")
    ]
    # A renewal alone is no move: the same version, nothing logged.
    caplog.clear()
    again = await registry.beat(backends.pool, [registry.BeatAttempt(task.id, running.attempt)], lease_seconds=30.0)
    assert again == {task.id: registry.Renewal(row.version, False)}
    assert not [r for r in caplog.records if r.getMessage() == "transition"]
    # Another attempt's beat is refused: absent from the answer.
    assert await registry.beat(backends.pool, [registry.BeatAttempt(task.id, running.attempt + 1)],
                               lease_seconds=30.0) == {}


async def test_the_consumer_gauges_are_read_once_per_period_not_on_every_beat(
    settings: Settings, backends: Backends, workers: Factory, spy: Spy, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads: list[float] = []
    original = JetStreamManager.consumer_info

    async def counted(self: JetStreamManager, *args: Any, **kwargs: Any) -> Any:
        reads.append(time.monotonic())
        return await original(self, *args, **kwargs)

    monkeypatch.setattr(JetStreamManager, "consumer_info", counted)
    handle = await workers(fleet(settings))
    levels = len(handle.worker.fetcher.levels)
    beats = await spy.wait(lambda b: b.registered, count=8)  # 0.3 s apart: all within one period
    assert beats[-1].at - beats[0].at < lease.CONSUMER_STATS_SECONDS
    assert len(reads) <= 2 * levels, (len(reads), levels)  # the worker's first beats', at most; was one per beat
