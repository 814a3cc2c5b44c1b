"""Live progress's two coalescing halves: the device threads' steps reach the event loop at most once per tick
(services/worker/steps.py), and a tenant's steps go as one NATS message (taskgate.wire.progress)."""

from __future__ import annotations

import asyncio
import threading

from services.worker.steps import StepInbox
from taskgate.wire import progress as progress_wire


def test_a_batch_decodes_to_its_items_and_anything_else_to_none() -> None:
    items = [
        progress_wire.message(task_id, 1, step * 5, step, 20) for task_id, step in ((7, 1), (2**62, 19), (300, 20))
    ]
    decoded = progress_wire.decode(progress_wire.encode(items))
    assert decoded == items
    assert progress_wire.decode(b"") == []
    body = progress_wire.encode(items)
    assert progress_wire.decode(body[:-1]) is None  # cut short
    assert progress_wire.decode(b"\xff\xff\xff\xff") is None  # a length that never ends
    assert progress_wire.decode(items[0].SerializeToString()) is None  # one bare item: its first byte is no length
    no_id = progress_wire.message(7, 1, 5, 1, 20)
    no_id.task_id = "x"
    assert progress_wire.decode(progress_wire.encode([no_id])) is None
    assert progress_wire.tenant_of("taskgate.live.progress.acme") == "acme"
    assert progress_wire.tenant_of("taskgate.live.progress.acme.7") is None


async def test_steps_from_threads_reach_the_loop_once_per_tick_newest_first() -> None:
    loop = asyncio.get_running_loop()
    seen: list[tuple[str, int, int]] = []
    handed = asyncio.Event()

    def handle(run: str, step: int, total: int) -> None:
        seen.append((run, step, total))
        handed.set()

    inbox: StepInbox[str] = StepInbox(0.3, handle)
    inbox.report(loop, "a", 1, 100)  # the first goes at once
    await asyncio.wait_for(handed.wait(), 5)
    assert seen == [("a", 1, 100)] and inbox.handovers == 1
    handed.clear()

    def slot(run: str) -> None:
        for step in range(2, 101):
            inbox.report(loop, run, step, 100)

    threads = [threading.Thread(target=slot, args=(run,)) for run in ("a", "b", "c")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    # 297 steps from three threads within one tick: one hand-over, each run's newest step only
    await asyncio.wait_for(handed.wait(), 5)
    assert inbox.handovers == 2
    assert sorted(seen[1:]) == [("a", 100, 100), ("b", 100, 100), ("c", 100, 100)]


async def test_a_flush_hands_a_runs_pending_step_over_at_once() -> None:
    loop = asyncio.get_running_loop()
    seen: list[tuple[str, int]] = []
    inbox: StepInbox[str] = StepInbox(60.0, lambda run, step, _total: seen.append((run, step)))
    inbox.report(loop, "a", 1, 3)
    await asyncio.sleep(0)  # the first hand-over
    await asyncio.sleep(0)
    inbox.report(loop, "a", 2, 3)
    inbox.report(loop, "b", 1, 3)
    inbox.flush("a")  # the next hand-over is a minute away: a's device phase ended, its step is handed over now
    assert seen == [("a", 1), ("a", 2)]
    inbox.flush("a")
    assert seen == [("a", 1), ("a", 2)]
