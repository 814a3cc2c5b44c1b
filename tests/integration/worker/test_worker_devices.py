"""A worker runs ceil(devices x 1.5) tasks: one at a time in a device's phase, the others encoding meanwhile."""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import AsyncIterator, Callable

import pytest

from services.worker import runner as runmod
from services.worker.engine import Worker
from taskgate import bus as busmod
from taskgate import store
from taskgate.config import ModelSpec, Settings
from taskgate.runtime import Backends
from taskgate.states import Status
from taskgate.store import CancelMode
from taskgate.store import admin as admin_store
from taskgate.store import workers as registry
from taskgate.wire import dispatch
from tests.support.factories import insert_task
from tests.support.harness import wait_for

SLEEPY = "sleepy"








class RecordingRunner:
    """A two-phase runner that records its phases; a task's encode waits (bounded) until the next task's render
    began."""

    def __init__(self) -> None:
        self.model_id = SLEEPY
        self.events: list[tuple[str, int]] = []
        self.rendering: dict[int, threading.Event] = {}
        self.started: set[int] = set()
        self._lock = threading.Lock()

    def _note(self, what: str, task_id: int) -> None:
        with self._lock:
            self.events.append((what, task_id))

    def render(self, inp: runmod.RunInput, on_step: runmod.OnStep, should_abort: runmod.ShouldAbort) -> runmod.Rendered:
        self._note("render", inp.task_id)
        self.started.add(inp.task_id)
        with self._lock:
            began = self.rendering.setdefault(inp.task_id, threading.Event())
        began.set()
        on_step(1, 1)
        self._note("rendered", inp.task_id)
        return runmod.Rendered(inp, None)

    def encode(self, rendered: runmod.Rendered) -> runmod.RunOutput:
        self._note("encode", rendered.inp.task_id)
        following = int(rendered.inp.params["next"])
        if following:  # overlap: the next task's device phase runs while this one encodes
            with self._lock:
                began = self.rendering.setdefault(following, threading.Event())
            assert began.wait(20), "the next render never started"
        self._note("encoded", rendered.inp.task_id)
        return runmod.RunOutput(b"{}", "application/json", "json", "00" * 32)


def rendering(runner: RecordingRunner, task_id: int) -> Callable[[], bool]:
    return lambda: task_id in runner.started


@pytest.fixture
async def one_device_worker(settings: Settings, backends: Backends) -> AsyncIterator[tuple[Worker, RecordingRunner]]:
    s = settings.model_copy(
        update={
            "models": {**settings.models, SLEEPY: ModelSpec(kind="sleep")},
            "worker_models": [SLEEPY],
            "progress_interval_seconds": 0.0,
        }
    )
    runner = RecordingRunner()
    worker = Worker(
        s, backends, {(SLEEPY, "cpu"): runner}, runmod.DevicePlan(["cpu"], 2, False, 2.0), "w-devices", [SLEEPY]
    )
    await worker.start()
    try:
        yield worker, runner
    finally:
        await worker.close()


async def test_the_next_tasks_device_phase_overlaps_this_ones_encoding(
    backends: Backends, one_device_worker: tuple[Worker, RecordingRunner]
) -> None:
    worker, runner = one_device_worker
    assert worker.status().slots == 2
    ids = [await insert_task(backends.pool, model_id=SLEEPY, prompt=f"p{n}") for n in range(4)]
    # each task knows the one after it (task ids grow with time); the last waits for nobody
    for n, task in enumerate(ids):
        follower = ids[n + 1].id if n + 1 < len(ids) else 0
        await backends.pool.execute(
            "UPDATE task SET request_payload = request_payload || jsonb_build_object('next', $2::text) WHERE id = $1",
            task.id, str(follower),
        )
    for task in ids:  # one at a time, so they are claimed in this order
        queued = await store.queue(backends.pool, task.id, actor="submit")
        row = queued.task
        assert queued.applied and row is not None
        await backends.bus.js.publish(
            busmod.task_subject(SLEEPY, row.priority), dispatch.encode(row), headers={"Nats-Msg-Id": f"{row.id}.q0"}
        )
        await wait_for(rendering(runner, row.id), within=20)

    async def all_done() -> bool:
        rows = [await store.get_task(backends.pool, t.id) for t in ids]
        return all(r is not None and r.status is Status.SUCCEEDED for r in rows)

    await wait_for(all_done, within=30)
    renders = [(what, t) for what, t in runner.events if what in ("render", "rendered")]
    # the device phases never overlap: each render ends before the next begins
    assert renders == [(what, t.id) for t in ids for what in ("render", "rendered")]
    for first, second in itertools.pairwise(ids):
        assert runner.events.index(("render", second.id)) < runner.events.index(("encoded", first.id))
    assert worker.devices.busy_seconds > 0


async def test_claims_stop_at_the_live_workers_slots_and_the_rest_stays_queued(backends: Backends) -> None:
    pool = backends.pool
    await registry.register(pool, registry.Registration("w1", (SLEEPY,), 2, 0, "cpu", False))
    first, second, third = [await insert_task(pool, model_id=SLEEPY, prompt=f"p{n}") for n in range(3)]

    async def claim(task_id: int) -> registry.Verdict:
        return (await registry.claim_for(
            pool, task_id, model_id=SLEEPY, cap=0, worker_id="w1", lease_seconds=10.0, actor="w1", cluster_cap=True
        )).verdict

    assert await claim(first.id) is registry.Verdict.CLAIMED
    assert await claim(second.id) is registry.Verdict.CLAIMED
    assert await claim(third.id) is registry.Verdict.CAPPED  # two slots, two running: the third waits
    assert await registry.cluster_load(pool, lease_seconds=10.0) == registry.ClusterLoad(capacity=2, running=2)
    assert (await store.cancel(pool, first.id, mode=CancelMode.SOFT, actor="test")).applied
    assert await claim(third.id) is registry.Verdict.CAPPED  # the soft-cancelled run still holds its slot
    assert await store.let_go(pool, first.id, attempt=1)
    assert await claim(third.id) is registry.Verdict.CLAIMED


async def test_one_gpu_workers_hold_one_and_a_half_each_and_claims_together_never_pass_the_cluster_cap(
    backends: Backends,
) -> None:
    """Four one-device workers (each ceil(1.5) = 2 slots of its own) hold floor(4 x 1.5) = 6 tasks between them, not 8;
    claims that arrive together queue on the cluster's lock, so none passes the cap with another."""
    pool = backends.pool
    for n in range(4):
        await registry.register(
            pool, registry.Registration(f"gpu{n}", (SLEEPY,), 2, 0, "cuda:0", False, devices=1, capacity=1.5)
        )
    stats = await admin_store.worker_stats(pool, lease_seconds=10.0)
    assert [(w.devices, w.capacity, w.slots) for w in stats] == [(1, 1.5, 2)] * 4
    tasks = [await insert_task(pool, model_id=SLEEPY, prompt=f"p{n}") for n in range(8)]

    async def claim(n: int, task_id: int) -> registry.Verdict:
        return (
            await registry.claim_for(
                pool,
                task_id,
                model_id=SLEEPY,
                cap=0,
                worker_id=f"gpu{n % 4}",
                lease_seconds=10.0,
                actor="w",
                cluster_cap=True,
            )
        ).verdict

    async with pool.acquire() as holder, holder.transaction():
        await holder.execute("SELECT pg_advisory_xact_lock(hashtextextended('taskgate.cluster', 0))")
        claims = [asyncio.create_task(claim(n, t.id)) for n, t in enumerate(tasks)]

        async def all_queued() -> bool:  # every claim is past its checks, waiting on the cluster's lock
            return (
                await holder.fetchval("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted") == 8
            )

        await wait_for(all_queued)
    verdicts = await asyncio.gather(*claims)
    assert sorted(v.value for v in verdicts) == ["capped"] * 2 + ["claimed"] * 6
    assert await registry.cluster_load(pool, lease_seconds=10.0) == registry.ClusterLoad(capacity=6, running=6)
    # a fifth one-GPU worker adds 1.5: 7.5 rounds down to 7, one more claim
    await registry.register(
        pool, registry.Registration("gpu4", (SLEEPY,), 2, 0, "cuda:0", False, devices=1, capacity=1.5)
    )
    capped = [t for t, v in zip(tasks, verdicts, strict=True) if v is registry.Verdict.CAPPED]
    assert [await claim(4, t.id) for t in capped] == [registry.Verdict.CLAIMED, registry.Verdict.CAPPED]
