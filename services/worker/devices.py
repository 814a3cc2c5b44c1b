"""The worker's devices: each runs one task's device phase (denoising, VAE decode) at a time, on a thread of its own.

A worker runs more tasks than it has devices (worker_slots_per_device): while one task holds a device, the others
encode and store their outputs, or wait here for the first device free that can run their model, in arrival order.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator, Collection
from dataclasses import dataclass

from taskgate import telemetry


@dataclass(eq=False)
class Lane:
    """One device's exclusive place: its thread, and since when a task holds it (None: free)."""

    index: int
    device: str
    executor: concurrent.futures.ThreadPoolExecutor
    busy_since: float | None = None


class Devices:
    """Hands out the devices one task at a time, first come first served, and counts their busy time."""

    def __init__(self, devices: list[str]) -> None:
        self.lanes = [
            Lane(i, device, concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"device-{i}"))
            for i, device in enumerate(devices)
        ]
        self.busy_seconds = 0.0  # every lane's, summed: a worker's device-busy fraction is this over wall time x lanes
        self._waiting: deque[tuple[Collection[str], asyncio.Future[Lane]]] = deque()

    @contextlib.asynccontextmanager
    async def use(self, devices: Collection[str]) -> AsyncIterator[Lane]:
        """acquire() and release() around a block (scripts/gpu_check.py's saturated queue)."""
        lane = await self.acquire(devices)
        try:
            yield lane
        finally:
            self.release(lane)

    def close(self) -> None:
        """Stops the lanes' threads (a phase in flight runs on; nothing new starts)."""
        for lane in self.lanes:
            lane.executor.shutdown(wait=False, cancel_futures=True)

    def take(self, devices: Collection[str]) -> Lane | None:
        """A free lane on one of `devices`, held now; None when all are busy (then acquire() waits in line)."""
        for lane in self.lanes:
            if lane.busy_since is None and lane.device in devices:
                lane.busy_since = time.monotonic()
                return lane
        return None

    async def acquire(self, devices: Collection[str]) -> Lane:
        """The first free lane on one of `devices`, after the earlier callers; hand it back with release()."""
        lane = self.take(devices)
        if lane is not None:
            return lane
        handed: asyncio.Future[Lane] = asyncio.get_running_loop().create_future()
        entry = (devices, handed)
        self._waiting.append(entry)
        try:
            return await handed
        except asyncio.CancelledError:
            if entry in self._waiting:
                self._waiting.remove(entry)
            elif handed.done() and not handed.cancelled():
                self.release(handed.result())  # handed over just as the waiter was cancelled: pass it on
            raise

    def release(self, lane: Lane) -> None:
        now = time.monotonic()
        if lane.busy_since is not None:
            busy = now - lane.busy_since
            self.busy_seconds += busy
            telemetry.DEVICE_BUSY.labels(lane.device).inc(busy)
        for entry in self._waiting:
            devices, handed = entry
            if lane.device in devices and not handed.done():
                self._waiting.remove(entry)
                lane.busy_since = now
                handed.set_result(lane)
                return
        lane.busy_since = None
