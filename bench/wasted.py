"""Wasted GPU-seconds under worker crashes: a queue of tiny Wan runs on one worker that is killed on a seeded schedule
(the fault suite's worker kills: a crash that releases nothing, its leases lapse, the scheduler queues its task again,
a new worker takes it), with step checkpoints on (every step) and off.

`python -m bench.wasted` (and `make bench`'s wasted phase). A killed worker cannot meter what it lost, so the bench
reads it off the killed runs the way their worker meters an interrupted attempt (services/worker/run.py, Run.metered):
the device seconds each had spent past its newest recorded checkpoint (all of them with none). Released and retried
attempts add what the rows say (task.wasted_seconds). Figures only: nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.device_busy import Variant
from bench.stats import Report
from services.scheduler import service as scheduler_service
from services.worker import runner as runmod
from services.worker.engine import Worker
from taskgate import store
from taskgate.config import ModelSpec, Settings
from taskgate.runtime import connect
from taskgate.states import Status
from taskgate.store import bench as bench_store
from taskgate.wire import dispatch
from taskgate_local import tinymodel
from taskgate_local.embedded import EmbeddedStack
from tests.support.factories import insert_task
from tests.support.harness import wait_for

MODEL = "wan-tiny"
# about a tenth of a second per step on one core: a kill lands mid-run
PARAMS = {"num_frames": 33, "width": 64, "height": 64, "num_inference_steps": 20, "guidance_scale": 5.0, "fps": 8}


@dataclass(frozen=True)
class Waste:
    """One queue under one variant: the crashes it took and the device seconds they cost."""

    variant: str
    tasks: int
    kills: int
    interrupted: int  # runs in flight at a kill
    wasted_s: float  # device seconds a later attempt computed again (killed runs, plus what the rows metered)
    counted_s: float  # device seconds metered as counting (the rows' device_seconds)
    wall_s: float


async def run_queue(
    state_dir: Path, stack: EmbeddedStack, model_dir: Path, variant: Variant, tasks: int, kills: int, rng: random.Random
) -> Waste:
    assert stack.postgres is not None and stack.nats is not None
    settings = Settings(
        database_url=stack.postgres.url,
        nats_url=stack.nats.url,
        state_dir=state_dir,
        result_store="fs",
        models={MODEL: variant.spec(ModelSpec(path=model_dir))},
        worker_metrics_port=0,
        scheduler_port=0,
        scheduler_metrics_port=0,
        lease_seconds=1.0,
        heartbeat_seconds=0.25,
        scan_interval_seconds=0.2,
        progress_interval_seconds=1.0,
        max_worker_losses=kills + 5,
    )
    backends = await connect(settings, "bench")
    sched = await scheduler_service.start(settings, backends)
    began = time.monotonic()
    rows, wasted, interrupted = [], 0.0, 0
    try:
        for n in range(tasks):
            task = await insert_task(
                backends.pool, model_id=MODEL, prompt=f"wasted {variant.label} {n}", params={**PARAMS, "seed": n}
            )
            out = await store.queue(backends.pool, task.id, actor="bench")
            assert out.task is not None
            await dispatch.publish(backends.bus, out.task, dispatch.Reason.SUBMITTED)
            rows.append(task.id)

        async def done() -> bool:
            return (await bench_store.count_by_status(backends.pool, rows)).get(Status.SUCCEEDED.value, 0) == tasks

        for n in range(kills + 1):
            runners = await asyncio.to_thread(runmod.load_runners, settings.models, ["cpu"])  # a fresh process's
            worker = Worker(
                settings, backends, runners, runmod.DevicePlan(["cpu"], 1, False, 1.0), f"wasted-{n}", [MODEL]
            )
            await worker.start()
            if n == kills:  # the last worker finishes the queue
                await wait_for(done, within=600, every=0.05)
                await worker.close()
                break
            await asyncio.sleep(rng.uniform(0.5, 2.0))  # the schedule's gap, then the kill lands mid-run

            async def running(w: Worker = worker) -> bool:
                return bool(w.runs) or await done()

            await wait_for(running, within=600, every=0.01)
            for run in list(worker.runs.values()):  # what its worker would meter as wasted, had it lived to
                newest = run.keeper.newest if run.keeper is not None else None
                spent = run.device_seconds_now()
                wasted += spent - min(newest.device_seconds if newest is not None else 0.0, spent)
                interrupted += 1
            await worker.kill()
        counted, metered_waste = await bench_store.metered(backends.pool, rows)
        return Waste(
            variant.label, tasks, kills, interrupted, wasted + metered_waste, counted, time.monotonic() - began
        )
    finally:
        await sched.stop()
        await backends.close()


async def measure(state_dir: Path, tasks: int, kills: int, seed: int) -> list[Waste]:
    stack = EmbeddedStack(state_dir / "servers").start()
    try:
        model_dir = await asyncio.to_thread(tinymodel.build_tiny_pipeline, state_dir / "models" / MODEL)
        found = []
        for variant in (Variant(checkpoints=True), Variant(checkpoints=False)):
            found.append(await run_queue(state_dir, stack, model_dir, variant, tasks, kills, random.Random(seed)))
        return found
    finally:
        stack.stop()


def add_figures(report: Report, section: str, found: list[Waste]) -> None:
    for w in found:
        per = w.wasted_s / w.interrupted if w.interrupted else 0.0
        report.add(
            section,
            f"wasted GPU-seconds, {w.variant}",
            w.wasted_s,
            "s",
            note=f"{w.kills} kills, {w.interrupted} runs interrupted, {w.tasks} tasks, {w.counted_s:.1f} s counted",
        )
        report.add(section, f"wasted per interruption, {w.variant}", per, "s")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.wasted", description=__doc__)
    parser.add_argument("--tasks", type=int, default=6, help="tiny Wan tasks in the queue")
    parser.add_argument("--kills", type=int, default=4, help="worker crashes")
    parser.add_argument("--seed", type=int, default=37, help="the kill schedule's seed")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="taskgate-wasted-") as tmp:
        found = asyncio.run(measure(Path(tmp), args.tasks, args.kills, args.seed))
    print(f"{'variant':16} {'tasks':>5} {'kills':>5} {'runs hit':>8} {'wasted s':>9} {'counted s':>9} {'wall s':>7}")
    for w in found:
        print(
            f"{w.variant:16} {w.tasks:>5} {w.kills:>5} {w.interrupted:>8} {w.wasted_s:>9.2f} {w.counted_s:>9.2f} "
            f"{w.wall_s:>7.1f}"
        )


if __name__ == "__main__":
    main()
