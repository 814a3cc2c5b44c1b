"""A worker's devices without a stack: one caller at a time per device in arrival order, and the plan of 1.5 tasks per
device."""

from __future__ import annotations

import asyncio

from services.worker import runner as runmod
from services.worker.devices import Devices
from tests.support.harness import wait_for


async def test_a_device_serves_one_caller_at_a_time_in_arrival_order() -> None:
    devices = Devices(["cuda:0", "cuda:1"])
    order: list[str] = []
    release = {name: asyncio.Event() for name in "abcd"}

    async def use(name: str, allowed: set[str]) -> None:
        lane = await devices.acquire(allowed)
        try:
            order.append(f"{name}@{lane.device}")
            await release[name].wait()
        finally:
            devices.release(lane)

    tasks = [asyncio.create_task(use("a", {"cuda:0", "cuda:1"})), asyncio.create_task(use("b", {"cuda:0", "cuda:1"}))]
    await wait_for(lambda: len(order) == 2)
    tasks += [asyncio.create_task(use("c", {"cuda:1"})), asyncio.create_task(use("d", {"cuda:0", "cuda:1"}))]
    await asyncio.sleep(0)  # c and d wait: both devices are held
    assert order == ["a@cuda:0", "b@cuda:1"]
    release["a"].set()  # cuda:0 frees: c cannot use it, d (behind c) can
    await wait_for(lambda: len(order) == 3)
    assert order[2] == "d@cuda:0"
    release["b"].set()
    await wait_for(lambda: len(order) == 4)
    assert order[3] == "c@cuda:1"
    release["c"].set()
    release["d"].set()
    await asyncio.gather(*tasks)
    assert all(lane.busy_since is None for lane in devices.lanes) and devices.busy_seconds > 0
    devices.close()


async def test_a_cancelled_waiter_passes_the_device_on() -> None:
    devices = Devices(["cpu"])
    held = asyncio.Event()
    done = asyncio.Event()

    async def hold() -> None:
        lane = await devices.acquire({"cpu"})
        held.set()
        await done.wait()
        devices.release(lane)

    holder = asyncio.create_task(hold())
    await held.wait()
    waiter = asyncio.create_task(asyncio.wait_for(devices.acquire({"cpu"}), 10))
    await asyncio.sleep(0)
    waiter.cancel()
    done.set()
    await holder
    lane = await asyncio.wait_for(devices.acquire({"cpu"}), 10)  # free again: the cancelled waiter did not keep it
    assert lane.device == "cpu"
    devices.release(lane)
    devices.close()


def test_device_plan_gives_one_and_a_half_tasks_per_device() -> None:
    sleepy = runmod.device_plan({"sleep"}, 0, 1.5)
    assert (sleepy.devices, sleepy.slots, sleepy.capacity) == (["cpu"], 1, 1.0)  # 'sleep'-only: one lane per slot
    assert runmod.device_plan({"sleep"}, 3, 1.5).devices == ["cpu"] * 3
    plan = runmod.device_plan({"diffusers"}, 0, 1.5)
    gpus = len([d for d in plan.devices if d.startswith("cuda")])
    assert plan.devices == ([f"cuda:{i}" for i in range(gpus)] or ["cpu"])
    assert plan.slots == -(-len(plan.devices) * 3 // 2) and plan.use_cuda == (gpus > 0)
    assert plan.capacity == len(plan.devices) * 1.5  # unrounded: the cluster cap sums these, then rounds down
    assert runmod.device_plan({"diffusers"}, 4, 1.5).capacity == 4.0  # slots set by hand are its capacity


def test_a_chat_models_slots_are_its_sequences_apart_from_the_shared_ones() -> None:
    from types import SimpleNamespace

    from services.worker.fetch import Fetcher, SlotTicket
    from taskgate.config import Settings

    chat_only = runmod.device_plan({"transformers"}, 0, 1.5)
    assert (chat_only.slots, chat_only.capacity) == (0, 0.0)  # every slot of a chat-only worker is a sequence
    started: list[str] = []

    async def start(ticket: SlotTicket, level: object, msg: object) -> None:
        started.append(ticket.slot.pool)

    fetcher = Fetcher(
        bus=SimpleNamespace(nc=None), settings=Settings(), worker_id="w", models=["wan", "chat"], slots=2 + 3,  # type: ignore[arg-type]
        start=start, spawn=lambda coro: coro.close(), changed=lambda: None, pools={"chat": 3},
    )
    assert [s.pool for s in fetcher.slots] == ["", "", "chat", "chat", "chat"]
    assert (
        len(fetcher.free_slots("wan")) == 2 and len(fetcher.free_slots("chat")) == 3 and len(fetcher.free_slots()) == 5
    )
    for slot in fetcher.free_slots("wan"):
        slot.busy = True  # the video tasks fill the shared slots: a chat task still has its own
    assert fetcher.free_slots("wan") == [] and len(fetcher.free_slots("chat")) == 3
