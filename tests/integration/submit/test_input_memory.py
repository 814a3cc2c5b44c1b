"""An accepted image cannot take a process down: small files that decode to huge sides (a 200 KB PNG of 8192 x 8192)
are refused from their header before any pixel is decoded, and images inside the pixel cap sent at once are decoded
within the process's pixel budget, one after another, not all at the same time. Measured on a real submit process."""

from __future__ import annotations

import asyncio
import os
import struct
import threading
import zlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import psutil
import pytest

from taskgate.config import Settings
from taskgate.runtime import Backends
from taskgate_api.v1 import gateway_pb2, gateway_pb2_grpc
from taskgate_local.embedded import free_port
from tests.support import factories
from tests.support.harness import ServiceProcess, settings_env

MB = 1024 * 1024


def solid_png(side: int, colour: bytes = b"\xc8\x1e\x3c") -> bytes:
    """A real PNG of side x side RGB pixels of one colour, built row by row (never the whole image in memory)."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    squeeze = zlib.compressobj(9)
    row = b"\x00" + colour * side
    idat = b"".join(squeeze.compress(row) for _ in range(side)) + squeeze.flush()
    header = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


class Peak:
    """The largest resident size of a process while the block runs, sampled every 5 ms."""

    def __init__(self, pid: int) -> None:
        self.process = psutil.Process(pid)
        self.base = self.process.memory_info().rss
        self.most = self.base

    @property
    def growth(self) -> int:
        return self.most - self.base

    def __enter__(self) -> Peak:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.most = max(self.most, self.process.memory_info().rss)
            self._stop.wait(0.005)

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()


@pytest.fixture
def submit_process(settings: Settings, backends: Backends, tmp_path: Path) -> Iterator[ServiceProcess]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TASKGATE_")}
    port = free_port()
    env.update(settings_env(settings.model_copy(update={"submit_port": port, "submit_metrics_port": 0})))
    service = ServiceProcess("submit", "services.submit", env, port, tmp_path / "submit.log")
    service.start()
    try:
        yield service
    finally:
        service.stop()


@pytest.fixture
async def stub(submit_process: ServiceProcess) -> AsyncIterator[gateway_pb2_grpc.TaskGatewayStub]:
    await submit_process.wait_serving()
    async with grpc.aio.insecure_channel(submit_process.address) as channel:
        yield gateway_pb2_grpc.TaskGatewayStub(channel)


async def upload(stub: gateway_pb2_grpc.TaskGatewayStub, md: factories.Metadata, data: bytes) -> grpc.StatusCode:
    async def parts() -> AsyncIterator[gateway_pb2.UploadInputRequest]:
        for at in range(0, len(data), MB):
            yield gateway_pb2.UploadInputRequest(data=data[at:at + MB])

    try:
        await stub.UploadInput(parts(), metadata=md, timeout=120)
    except grpc.aio.AioRpcError as exc:
        assert exc.code() != grpc.StatusCode.INVALID_ARGUMENT or "pixels" in (exc.details() or ""), exc.details()
        return exc.code()
    return grpc.StatusCode.OK


async def test_large_dimension_small_pngs_sent_at_once_stay_within_the_pixel_budget(
    stub: gateway_pb2_grpc.TaskGatewayStub, submit_process: ServiceProcess, backends: Backends
) -> None:
    md = await factories.key_for(backends, submits_per_minute=10_000)
    assert await upload(stub, md, solid_png(64)) == grpc.StatusCode.OK  # Pillow's plugins loaded before the baseline
    assert submit_process.proc is not None
    huge = solid_png(8192)  # about 200 KB that decode to 67 million pixels (about 800 MB as the gateway held them)
    assert len(huge) < 300_000
    with Peak(submit_process.proc.pid) as refused:
        codes = await asyncio.gather(*(upload(stub, md, huge) for _ in range(3)))
    assert codes == [grpc.StatusCode.INVALID_ARGUMENT] * 3
    print(f"refused: {refused.growth / MB:.0f} MB")
    assert refused.growth < 100 * MB, f"{refused.growth / MB:.0f} MB"

    inside = [solid_png(4096, bytes([i, 2, 3])) for i in range(3)]  # at the pixel cap: accepted
    with Peak(submit_process.proc.pid) as accepted:
        codes = await asyncio.gather(*(upload(stub, md, data) for data in inside))
    assert codes == [grpc.StatusCode.OK] * 3
    # one decode at a time (the budget is one image at the cap): about 70 MB each; all at once held 3 x 200 MB
    print(f"accepted: {accepted.growth / MB:.0f} MB")
    assert accepted.growth < 300 * MB, f"{accepted.growth / MB:.0f} MB"
    assert submit_process.alive
