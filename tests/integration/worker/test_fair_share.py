"""Fair share inside a priority: a dispatch message is a hint for its level, and a claim takes the fairest task."""

from __future__ import annotations

import functools
from typing import Any

from taskgate import eta, store
from taskgate.model import TaskRow
from taskgate.queueview import QueueView
from taskgate.runtime import Backends
from taskgate.states import Priority, Status
from taskgate.store import workers as registry
from tests.support.factories import SLEEPY, all_settings, insert_task, params, sleepy_settings, submit
from tests.support.harness import WorkerFactory as Factory
from tests.support.harness import wait_for


async def queued(backends: Backends, user_id: str, n: int) -> list[TaskRow]:
    """`n` QUEUED tasks of one tenant, oldest first."""
    tasks = []
    for i in range(n):
        task = await insert_task(backends.pool, user_id=user_id, model_id=SLEEPY, prompt=f"{user_id} {i}")
        assert (await store.queue(backends.pool, task.id, actor="submit")).applied
        tasks.append(task)
    return tasks


async def ended(backends: Backends) -> int:
    """A cancelled task of the level: the task its message names need not be the one it claims."""
    task = await insert_task(backends.pool, user_id="gone", model_id=SLEEPY, prompt="gone")
    assert (await store.cancel(backends.pool, task.id, mode=store.CancelMode.HARD, actor="test")).applied
    return task.id


async def claim_order(backends: Backends, hint: int, n: int) -> list[str]:
    """The tenants of `n` successive claims for messages naming `hint` (a hint, not an assignment)."""
    order = []
    for _ in range(n):
        got = await registry.claim_for(
            backends.pool, hint, model_id=SLEEPY, cap=0, worker_id="w", lease_seconds=60, actor="w"
        )
        assert got.verdict is registry.Verdict.CLAIMED and got.task is not None
        order.append(got.task.user_id)
    return order


async def test_claims_go_round_robin_across_tenants_and_follow_their_weights(backends: Backends) -> None:
    hint = await ended(backends)
    await queued(backends, "bulk", 12)
    await queued(backends, "small", 2)
    # equal weights: turns, the older head first on a tie; a tenant with nothing left drops out
    assert await claim_order(backends, hint, 6) == ["bulk", "small", "bulk", "small", "bulk", "bulk"]

    await backends.pool.execute("INSERT INTO tenant (id, share_weight) VALUES ('heavy', 3), ('light', 1)")
    await queued(backends, "heavy", 9)
    await queued(backends, "light", 3)
    await backends.pool.execute(
        "UPDATE task SET status = 'CANCELED', finished_at = now() WHERE user_id = 'bulk' AND status = 'QUEUED'"
    )
    order = await claim_order(backends, hint, 12)
    assert order.count("heavy") == 9 and order.count("light") == 3
    assert all(order[i:i + 4].count("light") == 1 for i in (0, 4, 8)), order  # three of heavy's for one of light's


async def test_a_tenant_that_rejoins_banks_no_credit(backends: Backends) -> None:
    hint = await ended(backends)
    await queued(backends, "steady", 10)
    await queued(backends, "sporadic", 1)
    assert await claim_order(backends, hint, 2) == ["steady", "sporadic"]
    assert await claim_order(backends, hint, 5) == ["steady"] * 5  # sporadic has nothing queued meanwhile
    await queued(backends, "sporadic", 3)
    # it joins at the level's current pass: next in turn, then turns again, never five in a row
    assert await claim_order(backends, hint, 4) == ["sporadic", "steady", "sporadic", "steady"]


async def test_a_message_says_when_its_level_is_due_and_takes_its_own_created_task(backends: Backends) -> None:
    pool = backends.pool
    waiting = (await queued(backends, "a", 1))[0]
    await pool.execute("UPDATE task SET not_before = now() + interval '30 seconds' WHERE id = $1", waiting.id)

    async def claim(task_id: int) -> registry.WorkerClaim:
        return await registry.claim_for(
            pool, task_id, model_id=SLEEPY, cap=0, worker_id="w", lease_seconds=60, actor="w"
        )

    early = await claim(waiting.id)
    assert early.verdict is registry.Verdict.EARLY and early.wait_seconds is not None and 25 < early.wait_seconds <= 30
    created = await insert_task(pool, user_id="b", model_id=SLEEPY)  # the message outran its commit's QUEUED move
    got = await claim(created.id)
    assert got.verdict is registry.Verdict.CLAIMED and got.task is not None and got.task.id == created.id
    assert got.from_status is Status.CREATED
    await pool.execute("UPDATE task SET not_before = NULL WHERE id = $1", waiting.id)
    got = await claim(waiting.id)
    assert got.verdict is registry.Verdict.CLAIMED and got.task is not None and got.task.id == waiting.id
    assert (await store.cancel(pool, created.id, mode=store.CancelMode.HARD, actor="t")).applied
    # its own task ended and nothing in the level is queued: a spare message, acked
    assert (await claim(created.id)).verdict is registry.Verdict.FINISHED


async def test_a_single_task_waits_behind_at_most_one_task_of_anothers_bulk(
    settings: Any, backends: Backends, workers: Factory
) -> None:
    s = sleepy_settings(settings, sleep=0.15)  # one slot
    await workers(s)
    bulk = [await submit(backends, user_id="bulk", params=params(steps=1, seed=n)) for n in range(25)]
    await wait_for(lambda: _started(backends, bulk, 3), within=20)
    single = await submit(backends, user_id="single", params=params(steps=1, seed=99))
    queued_at = (await store.get_task(backends.pool, single.id)).queued_at  # type: ignore[union-attr]
    await wait_for(lambda: _status(backends, single.id, Status.SUCCEEDED), within=20)
    done = await store.get_task(backends.pool, single.id)
    assert done is not None and done.started_at is not None and queued_at is not None
    ahead = await backends.pool.fetchval(
        "SELECT count(*) FROM task WHERE user_id = 'bulk' AND started_at > $1 AND started_at < $2",
        queued_at,
        done.started_at,
    )
    assert ahead <= 1, ahead  # the task running when it came, and at most one claim already under way
    left = await backends.pool.fetchval("SELECT count(*) FROM task WHERE user_id = 'bulk' AND status = 'QUEUED'")
    assert left > 10  # the bulk was still far from done: the single task did not just wait its turn at the end


async def _started(backends: Backends, tasks: list[TaskRow], n: int) -> bool:
    return await backends.pool.fetchval(
        "SELECT count(*) FROM task WHERE id = ANY($1::bigint[]) AND started_at IS NOT NULL", [t.id for t in tasks]
    ) >= n


async def _status(backends: Backends, task_id: int, status: Status) -> bool:
    row = await store.get_task(backends.pool, task_id)
    return row is not None and row.status is status




async def test_the_eta_follows_fair_share_and_the_priority_weights_within_thirty_percent(
    settings: Any, backends: Backends, workers: Factory
) -> None:
    s = sleepy_settings(settings, sleep=0.3)  # one slot; fetch weights 6:3:1
    await workers(s)
    warm = [await submit(backends, user_id="warm", params=params(steps=1, seed=n)) for n in range(3)]
    for task in warm:  # recent runs of the size class: what a run takes
        await wait_for(functools.partial(_status, backends, task.id, Status.SUCCEEDED), within=20)
    for n in range(30):
        await submit(backends, user_id="bulk", params=params(steps=1, seed=100 + n))
    light = [await submit(backends, user_id="light", params=params(steps=1, seed=200 + n)) for n in range(4)]
    for n in range(2):
        await submit(backends, user_id="low", priority=Priority.LOW, params=params(steps=1, seed=300 + n))
    target = light[-1]
    asked = await backends.pool.fetchval("SELECT now()")
    est = (await eta.estimates(backends.pool, [target.id], s)).get(target.id)
    assert est is not None and est.start is not None
    # FIFO under strict priority would put it 34th; fair share makes it about the 8th NORMAL claim, and LOW takes
    # one claim in four while it has tasks: about the 10th claim
    assert 8 <= est.queue_position <= 12, est.queue_position
    await wait_for(lambda: _status(backends, target.id, Status.SUCCEEDED), within=60)
    done = await store.get_task(backends.pool, target.id)
    assert done is not None and done.started_at is not None
    predicted, observed = (est.start - asked).total_seconds(), (done.started_at - asked).total_seconds()
    assert abs(predicted - observed) <= 0.3 * observed, (predicted, observed)



async def queued_for(backends: Backends, user_id: str, end_user: str, n: int) -> list[TaskRow]:
    """`n` QUEUED tasks of one end user of a tenant, oldest first."""
    tasks = []
    for i in range(n):
        task = await insert_task(backends.pool, user_id=user_id, end_user=end_user, model_id=SLEEPY,
                                 prompt=f"{user_id}/{end_user} {i}")
        assert (await store.queue(backends.pool, task.id, actor="submit")).applied
        tasks.append(task)
    return tasks


async def end_user_order(backends: Backends, hint: int, n: int) -> list[str]:
    """`tenant/end user` of `n` successive claims for messages naming `hint`."""
    order = []
    for _ in range(n):
        got = await registry.claim_for(
            backends.pool, hint, model_id=SLEEPY, cap=0, worker_id="w", lease_seconds=60, actor="w"
        )
        assert got.verdict is registry.Verdict.CLAIMED and got.task is not None
        order.append(f"{got.task.user_id}/{got.task.end_user}")
    return order


async def test_end_users_take_turns_inside_their_tenants_turn(backends: Backends) -> None:
    hint = await ended(backends)
    await queued_for(backends, "backend", "heavy", 200)  # one end user's bulk
    await queued(backends, "other", 3)
    assert (await end_user_order(backends, hint, 2)) == ["backend/heavy", "other/"]
    await queued_for(backends, "backend", "light", 2)  # another end user of the same tenant arrives later
    # tenants alternate; inside backend's turns its end users alternate: light's first task waits behind at most one
    # of heavy's, however long heavy's bulk
    order = await end_user_order(backends, hint, 6)
    assert order == ["backend/light", "other/", "backend/heavy", "other/", "backend/light", "backend/heavy"], order
    # the queue position follows that order: light's next task would be claimed within a few, not after 198 of heavy's
    light = await insert_task(backends.pool, user_id="backend", end_user="light", model_id=SLEEPY, prompt="later")
    assert (await store.queue(backends.pool, light.id, actor="submit")).applied
    estimate = (await eta.estimates(backends.pool, [light.id], backends.settings))[light.id]
    assert 1 <= estimate.queue_position <= 2, estimate  # 197 of heavy's tasks are queued in the same level
    # GetTask's answer (the process's queue snapshot) places it the same way
    row = await store.get_task(backends.pool, light.id)
    assert row is not None
    polled = await QueueView(backends.pool, all_settings(backends)).estimate(row)
    assert polled is not None and polled.queue_position == estimate.queue_position
    heavy_next = await backends.pool.fetchval(
        "SELECT id FROM task WHERE end_user = 'heavy' AND status = 'QUEUED' ORDER BY queued_at, id OFFSET 5 LIMIT 1")
    heavy_row = await store.get_task(backends.pool, heavy_next)
    assert heavy_row is not None
    by_sql = (await eta.estimates(backends.pool, [heavy_next], backends.settings))[heavy_next].queue_position
    by_view = await QueueView(backends.pool, all_settings(backends)).estimate(heavy_row)
    assert by_view is not None and by_view.queue_position == by_sql > 6  # light's task comes before heavy's 6th
