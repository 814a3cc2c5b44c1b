"""A queue that tells a backlog from a loss: tasks moving through a busy queue never time out for the queue timeout."""

from __future__ import annotations

from services.scheduler import service as scheduler_service
from taskgate.config import Settings
from taskgate.runtime import Backends
from tests.support.factories import params, sleepy_settings, submit
from tests.support.harness import WorkerFactory as Factory
from tests.support.harness import wait_for


async def test_a_backlog_of_thirty_behind_one_slot_all_succeed_under_a_short_queue_timeout(
    settings: Settings, backends: Backends, workers: Factory
) -> None:
    # one slot, a 1 s queue timeout and 2 re-publishes: the last of 30 tasks waits far longer than 3 s in QUEUED
    s = sleepy_settings(settings, sleep=0.15, queue_timeout_seconds=1.0).model_copy(
        update={"scan_interval_seconds": 0.2}
    )
    scheduler = await scheduler_service.start(s)
    try:
        await workers(s)
        tasks = [await submit(backends, params=params(steps=1, seed=n)) for n in range(30)]
        ids = [t.id for t in tasks]

        async def finished() -> bool:
            left = await backends.pool.fetchval(
                "SELECT count(*) FROM task WHERE id = ANY($1::bigint[]) AND finished_at IS NULL", ids
            )
            return left == 0

        await wait_for(finished, within=90)
        assert scheduler.scheduler.passes > 10  # the queued scan ran all along
    finally:
        await scheduler.stop()
    rows = await backends.pool.fetch(
        "SELECT status::text, count(*) AS n, sum(publish_count) AS rounds FROM task WHERE id = ANY($1::bigint[]) GROUP "
        "BY 1",
        ids,
    )
    assert [(r["status"], r["n"], r["rounds"]) for r in rows] == [("SUCCEEDED", 30, 0)]  # none re-published either
