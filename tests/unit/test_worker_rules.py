"""The worker's pure rules: the weighted pick of a priority level, and final writes retried through a short outage."""

from __future__ import annotations

import time

import pytest

from services.worker.consumer import Level, Weighted
from services.worker.retry import persist
from taskgate.states import Priority


def test_weighted_choice_follows_weights_without_starving_low() -> None:
    levels = [Level("m", Priority.HIGH, 6, "h"), Level("m", Priority.NORMAL, 3, "n"), Level("m", Priority.LOW, 1, "l")]
    picks = [Weighted.pick(levels).priority for _ in range(100)]
    assert [picks.count(p) for p in (Priority.HIGH, Priority.NORMAL, Priority.LOW)] == [60, 30, 10]
    assert all(Priority.LOW in picks[i : i + 10] for i in range(0, 100, 10))  # LOW gets a turn in every 10
    assert picks[0] == Priority.HIGH


def test_high_goes_first_when_it_appears_beside_a_busy_low_level() -> None:
    high, low = Level("m", Priority.HIGH, 6, "h"), Level("m", Priority.LOW, 1, "l")
    for _ in range(20):
        Weighted.forget([high])
        assert Weighted.pick([low]) is low
    Weighted.forget([])
    assert Weighted.pick([high, low]) is high


async def test_final_writes_are_retried_through_a_short_outage_then_given_up() -> None:
    calls: list[float] = []

    async def flaky() -> str:
        calls.append(time.monotonic())
        if len(calls) < 3:
            raise ConnectionResetError("connection reset")
        return "written"

    assert await persist(2.0, "succeed", 1, flaky) == "written" and len(calls) == 3
    calls.clear()

    async def down() -> str:
        calls.append(time.monotonic())
        raise ConnectionRefusedError("refused")

    with pytest.raises(ConnectionRefusedError):
        await persist(0.3, "succeed", 1, down)
    assert len(calls) >= 2 and calls[-1] - calls[0] <= 0.3
