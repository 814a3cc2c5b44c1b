"""taskgate.queueview's shared reads: a poll answers from the snapshot and its class's run history while they are
young enough, and from the older ones while the next are read (up to three periods) — a slow read of either, once
per period, is never a poll's wait."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime
from typing import Any

import pytest

from taskgate import queueview
from taskgate.config import Settings
from taskgate.eta import Estimate
from taskgate.model import TaskRow
from taskgate.states import Priority, Status
from taskgate.store import estimates
from taskgate.store.estimates import QueueRows, RunHistory

PERIOD = 0.2


class Reads:
    """Stands in for the two reads (store.queue_snapshot, store.run_history): counts them and, while `held`,
    keeps them waiting."""

    def __init__(self) -> None:
        self.snapshots = 0
        self.histories = 0
        self.held = asyncio.Event()
        self.held.set()

    async def queue_snapshot(self, db: Any, **_: Any) -> QueueRows:
        self.snapshots += 1
        await self.held.wait()
        return QueueRows(now=datetime.now(UTC), tenants=[], workers=[(("m",), 2.0)])

    async def run_history(self, db: Any, *key: Any, **_: Any) -> RunHistory:
        self.histories += 1
        await self.held.wait()
        return RunHistory(run_seconds=10.0 * self.histories, runs=3)


def _task(status: Status = Status.QUEUED) -> TaskRow:
    now = datetime.now(UTC)
    return TaskRow(
        id=7, user_id="t", idempotency_key="k", request_hash="h", task_type="text-to-video", model_id="m", prompt="p",
        request_payload={"num_frames": 9, "width": 32, "height": 32}, priority=Priority.NORMAL, queue_name="m.5",
        status=status, progress=0, version=1, attempt=0, retry_count=0, max_retries=3, created_at=now, updated_at=now,
        queued_at=now,
    )


def _run(estimate: Estimate | None) -> float:
    """The run time an estimate used (its finish is one run after its start)."""
    assert estimate is not None and estimate.start is not None and estimate.finish is not None
    return (estimate.finish - estimate.start).total_seconds()


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> Reads:
    fake = Reads()
    monkeypatch.setattr(estimates, "queue_snapshot", fake.queue_snapshot)
    monkeypatch.setattr(estimates, "run_history", fake.run_history)
    return fake


async def test_polls_share_the_reads_and_an_old_answer_stands_while_the_next_is_read(
    settings: Settings, reads: Reads
) -> None:
    view = queueview.QueueView(None, settings.model_copy(update={"eta_snapshot_seconds": PERIOD}))
    first = await view.estimate(_task())
    assert first is not None and first.queue_position == 1 and _run(first) == 10.0
    for _ in range(20):
        await view.estimate(_task())
        await view.estimate(_task(Status.PROCESSING))
    assert (reads.snapshots, reads.histories) == (1, 1)  # one of each for all those polls

    await asyncio.sleep(PERIOD * 1.5)  # older than a period, younger than three
    reads.held.clear()  # the next reads hang
    began = time.monotonic()
    queued, running = await asyncio.wait_for(
        asyncio.gather(view.estimate(_task()), view.estimate(_task(Status.PROCESSING))), PERIOD)
    assert time.monotonic() - began < PERIOD / 2
    assert queued is not None and _run(queued) == 10.0  # the old history's still
    assert running is not None and running.finish is not None
    assert (reads.snapshots, reads.histories) == (2, 2)  # the next ones under way, one each
    reads.held.set()
    await asyncio.sleep(0.01)
    later = await view.estimate(_task())
    assert later is not None and _run(later) == 20.0  # the new history's


async def test_past_three_periods_a_poll_waits_for_the_read(settings: Settings, reads: Reads) -> None:
    view = queueview.QueueView(None, settings.model_copy(update={"eta_snapshot_seconds": PERIOD / 4}))
    assert await view.estimate(_task()) is not None
    await asyncio.sleep(PERIOD)  # four periods
    reads.held.clear()
    waiting = asyncio.create_task(view.estimate(_task()))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    reads.held.set()
    assert await asyncio.wait_for(waiting, 5) is not None
    assert (reads.snapshots, reads.histories) == (2, 2)
