"""The fault suite: hundreds of tiny real tasks through the whole stack while every process is SIGKILLed and restarted.

Run with `make test-faults`. The seed is printed; TASKGATE_FAULT_SEED=<seed> replays the same schedule of faults,
task mix and webhook failures (timings still vary). TASKGATE_FAULT_TASKS changes the number of tasks (default 300).
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import grpc
import pytest

from taskgate import auth
from taskgate_api.v1 import gateway_pb2, gateway_pb2_grpc
from taskgate_local import tinymodel
from tests.support.chaos import (
    CALLBACK_SHARE,
    CHANNEL_OPTIONS,
    QUIESCE_SECONDS,
    RETRY_CODES,
    SLEEP_PARAMS,
    TENANT,
    WAN_PARAMS,
    Chaos,
    Submissions,
    check_histories,
    dump_open,
    fault_settings,
    hook_reply,
    print_summary,
    quiescent,
)
from tests.support.harness import Cluster, wait_for
from tests.support.webhooks import WebhookReceiver

pytestmark = [pytest.mark.faults, pytest.mark.timeout(1200)]

TASKS = int(os.environ.get("TASKGATE_FAULT_TASKS", "300"))
WAN_SHARE = 3  # every third task runs the tiny Wan pipeline, the rest the 'sleep' model
SUBMIT_WINDOW = 80.0  # seconds over which the tasks are submitted (the faults happen meanwhile)
SUBMITTERS = 8
KILLS_PER_ROLE = 2
ROLES = ("submit", "scheduler", "worker-1", "worker-2", "notifier")








@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    """Embedded servers of its own, the tiny model, and the five service processes, all started."""
    model_dir = tmp_path / "models" / "wan-tiny"
    c = Cluster(tmp_path / "cluster", fault_settings(model_dir))
    try:
        await asyncio.gather(
            asyncio.to_thread(c.start_servers), asyncio.to_thread(tinymodel.build_tiny_pipeline, model_dir)
        )
        c.add("submit", "services.submit")
        c.add("scheduler", "services.scheduler")
        c.add("notifier", "services.notifier")
        for name in ("worker-1", "worker-2"):
            worker = c.add(name, "services.worker", worker_slots=1)
            worker.env.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})  # two workers share two cores
        yield c
    finally:
        await asyncio.to_thread(c.stop)






async def submit_all(stub: Any, md: Any, rng: random.Random, receiver: WebhookReceiver, subs: Submissions) -> None:
    """Submits TASKS tasks at a steady pace over SUBMIT_WINDOW, retrying each (same idempotency key) until OK."""
    plan = []
    for i in range(TASKS):
        wan = i % WAN_SHARE == 0
        callback = rng.random() < CALLBACK_SHARE
        plan.append((i, wan, callback))
    queue: asyncio.Queue[tuple[int, bool, bool]] = asyncio.Queue()
    for item in plan:
        queue.put_nowait(item)
    pace = SUBMIT_WINDOW / TASKS
    start = time.monotonic()

    async def one(i: int, wan: bool, callback: bool) -> None:
        key = f"task-{i}"
        request = gateway_pb2.SubmitTaskRequest(
            prompt=f"fault task {i}: a red fox running through snow",
            model_id="wan-tiny" if wan else "sleepy",
            params=WAN_PARAMS if wan else SLEEP_PARAMS,
            idempotency_key=key,
            callback_url=receiver.url(f"/hook/{i}") if callback else "",
            max_retries=3,
        )
        request.params.seed = i
        if callback:
            subs.with_callback.add(key)
        deadline = time.monotonic() + 120
        while True:
            try:
                resp = await stub.SubmitTask(request, metadata=md, timeout=5)
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
                if code in RETRY_CODES and time.monotonic() < deadline:
                    subs.retries[code.name] += 1
                    await asyncio.sleep(0.1)
                    continue
                subs.given_up[key] = code.name
                return
            subs.acked[key] = int(resp.task.id)
            return

    async def worker() -> None:
        while not queue.empty():
            i, wan, callback = queue.get_nowait()
            await asyncio.sleep(max(0.0, start + i * pace - time.monotonic()))
            await one(i, wan, callback)

    await asyncio.gather(*(worker() for _ in range(SUBMITTERS)))






async def test_every_task_survives_kills_of_every_process(cluster: Cluster, capsys: pytest.CaptureFixture[str]) -> None:
    seed = int(os.environ.get("TASKGATE_FAULT_SEED") or random.SystemRandom().randrange(2**32))
    with capsys.disabled():
        print(f"\nfault suite: seed {seed} (replay: TASKGATE_FAULT_SEED={seed} make test-faults), {TASKS} tasks")
    chaos_rng, task_rng, hook_rng = (random.Random(f"{seed}-{part}") for part in ("chaos", "tasks", "hooks"))
    t_start = time.monotonic()
    db = await asyncpg.create_pool(cluster.settings.database_url, min_size=0, max_size=4)
    assert db is not None
    try:
        await _run(cluster, db, seed, chaos_rng, task_rng, hook_rng, t_start, capsys)
    finally:
        await db.close()


async def _run(
    cluster: Cluster,
    db: asyncpg.Pool,
    seed: int,
    chaos_rng: random.Random,
    task_rng: random.Random,
    hook_rng: random.Random,
    t_start: float,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The services migrate the database as they start; the key needs the schema.
    await cluster.start()
    key, secret = await auth.create_key(
        db, cluster.settings.api_key_pepper, TENANT, max_pending=100_000, submits_per_minute=1_000_000
    )
    assert secret is not None
    md = (("authorization", f"Bearer {key}"),)
    setup_s = time.monotonic() - t_start
    subs = Submissions()
    async with WebhookReceiver(hook_reply(hook_rng)) as receiver, grpc.aio.insecure_channel(
        cluster["submit"].address, options=CHANNEL_OPTIONS
    ) as channel:
        stub = gateway_pb2_grpc.TaskGatewayStub(channel)
        chaos = Chaos(cluster, db, stub, md, chaos_rng)
        targets = chaos.plan(ROLES, KILLS_PER_ROLE)
        gap = (0.5, 2.0)
        t_chaos = time.monotonic()
        await asyncio.gather(submit_all(stub, md, task_rng, receiver, subs), chaos.run(targets, gap))
        chaos_s = time.monotonic() - t_chaos
        t_drain = time.monotonic()
        expected = len(subs.acked) + len(chaos.probes)
        try:
            await wait_for(lambda: quiescent(db, expected), QUIESCE_SECONDS, every=0.5)
        except TimeoutError:
            with capsys.disabled():
                print(f"\nnot quiescent {QUIESCE_SECONDS:g} s after the last fault (seed {seed}); faults:")
                for f in chaos.faults:
                    print(f"  {f.target:<10} at {f.at:6.1f}s recovered {f.recovery_s}s ({f.measure})")
                await dump_open(db, cluster)
            raise
        drain_s = time.monotonic() - t_drain
        report = await check_histories(db, cluster, subs, chaos, receiver, secret)
    with capsys.disabled():
        print_summary(seed, subs, chaos, report, setup_s, chaos_s, drain_s, time.monotonic() - t_start)
    assert not report["problems"], "\n".join(report["problems"])










