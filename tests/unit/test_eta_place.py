"""taskgate.eta.place: the claims up to a queued task are the worker's own weighted picks, counted claim by claim —
while skipping the round robin's repeated rounds keeps the cost flat however deep the task is."""

from __future__ import annotations

import random
import time
from datetime import UTC, datetime

from services.worker.consumer import Level, Weighted
from taskgate.eta import SIMULATED, place
from taskgate.states import Priority, Status
from taskgate.store.estimates import EtaInputs

LEVELS = (Priority.HIGH, Priority.NORMAL, Priority.LOW)


def _inputs(position: int, queued: dict[int, int], priority: int) -> EtaInputs:
    return EtaInputs(
        task_id=1, status=Status.QUEUED, version=1, progress=0, model_id="m", level_position=position, run_seconds=1.0,
        runs=3, slots=1.0, now=datetime.now(UTC), priority=priority, queued=queued, max_output_tokens=None,
        token_seconds=None, mean_output_tokens=None,
    )


def _picked(position: int, queued: dict[int, int], priority: int, weights: tuple[int, int, int]) -> int:
    """The claims until the task's level has given `position` of its tasks: services/worker/consumer.py's Weighted
    picks over the levels with tasks, a level that empties forgotten."""
    left = {p: n for p, n in queued.items() if n > 0 and p != priority}
    left[priority] = max(position, 1)
    levels = {p: Level("m", p, max(1, weights[LEVELS.index(p)]), str(p)) for p in left}
    claims = 0
    while True:
        best = Weighted.pick([levels[p] for p in LEVELS if p in left])
        claims += 1
        left[best.priority] -= 1
        if left[best.priority] == 0:
            if best.priority == priority:
                return claims
            Weighted.forget([best])
            del left[best.priority]


def test_the_claims_are_the_workers_picks_claim_by_claim() -> None:
    rng = random.Random(38)
    for _ in range(1500):
        priority = rng.choice(LEVELS)
        weights = (6, 3, 1) if rng.random() < 0.3 else (rng.randint(0, 13), rng.randint(0, 13), rng.randint(0, 13))
        deep = rng.choice((3, 40, 400, 1500))
        queued = {p: rng.randint(0, deep) for p in LEVELS if rng.random() < 0.8}
        position = rng.randint(0, deep)
        expected = _picked(position, queued, priority, weights)
        assert place(_inputs(position, queued, priority), weights) == (float(expected), expected), (
            position, queued, priority, weights)


def test_a_deep_task_costs_what_a_shallow_one_does() -> None:
    def cost(position: int, queued: dict[int, int]) -> float:
        inputs = _inputs(position, queued, Priority.NORMAL)
        began = time.process_time()
        for _ in range(20):
            place(inputs, (6, 3, 1))
        return (time.process_time() - began) / 20

    shallow = min(cost(10, {Priority.HIGH: 12, Priority.LOW: 7}) for _ in range(3))
    deep = SIMULATED // 3 - 1
    # one claim at a time, ~3 µs each: ~20 ms for this one; skipping the rounds, about the shallow one's
    assert min(cost(deep, {Priority.HIGH: deep, Priority.LOW: deep}) for _ in range(3)) < 20 * shallow + 0.001
