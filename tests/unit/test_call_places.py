"""taskgate.throttle's pacing and fair call places, without a server: the order calls are let in."""

from __future__ import annotations

import asyncio

import pytest

from taskgate import errors
from taskgate.throttle import Late, Pace, Places


def test_pace_lets_a_burst_through_then_spaces_calls_and_refuses_past_the_wait() -> None:
    pace = Pace(rate=10.0, burst=3, max_wait=0.25)
    assert [pace.wait("a", now=100.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert pace.wait("a", now=100.0) == pytest.approx(0.1)
    assert pace.wait("a", now=100.0) == pytest.approx(0.2)
    with pytest.raises(Late) as late:
        pace.wait("a", now=100.0)
    assert late.value.seconds == pytest.approx(0.3)  # not counted: the next call is told the same
    assert pace.wait("b", now=100.0) == 0.0  # another tenant's schedule is its own
    assert pace.wait("a", now=101.0) == 0.0  # the schedule caught up


async def test_places_serve_waiting_tenants_in_turn_and_a_tenants_calls_behind_its_own() -> None:
    places = Places(per_tenant=2, per_process=3, waiting_per_tenant=10)
    for tenant in ("a", "a", "b"):
        await places.enter(tenant)
    assert places.running == 3
    order: list[str] = []

    async def call(tenant: str) -> None:
        await places.enter(tenant)
        order.append(tenant)

    waiting = [asyncio.create_task(call(t)) for t in ("a", "a", "a", "b", "c")]
    await asyncio.sleep(0)
    assert (places.waiting("a"), places.waiting("b"), places.waiting("c")) == (3, 1, 1)
    for tenant in ("a", "a", "b", "a", "b"):  # each finished call frees one place
        places.leave(tenant)
        await asyncio.sleep(0)
    await asyncio.wait_for(asyncio.gather(*waiting), 1.0)
    # a freed place goes to the next waiting tenant in turn, never twice to a tenant while another waits
    assert order == ["a", "b", "c", "a", "a"]


async def test_a_tenants_line_is_bounded_and_a_cancelled_wait_leaves_it() -> None:
    places = Places(per_tenant=1, per_process=0, waiting_per_tenant=1)
    await places.enter("a")
    first = asyncio.create_task(places.enter("a"))
    await asyncio.sleep(0)
    with pytest.raises(errors.ApiError):
        await places.enter("a")
    first.cancel()
    await asyncio.sleep(0)
    assert places.waiting("a") == 0
    places.leave("a")
    await asyncio.wait_for(places.enter("a"), 1.0)
