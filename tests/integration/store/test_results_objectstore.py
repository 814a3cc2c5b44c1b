"""The JetStream object store as the result store: whole reads checked against the stored digest; a read whose chunks
are gone, or whose server stops answering, ends at once or within the stall limit instead of waiting for ever (as
nats-py's own ObjectStore.get does when its ordered consumer misses a chunk)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest

from taskgate import bus as busmod
from taskgate import results
from taskgate.bus import RESULTS_BUCKET
from taskgate.runtime import Backends
from taskgate_local.embedded import EmbeddedNats


async def _read(store: results.ResultStore, uri: str) -> bytes:
    return b"".join([chunk async for chunk in store.read(uri)])


async def test_an_object_reads_back_whole_and_a_deleted_one_is_not_found(backends: Backends) -> None:
    store = results.ObjectStoreResults(backends.bus, stall_seconds=5)
    data = os.urandom(3 * results.CHUNK + 17)  # several of the bucket's chunks, the last one short
    put = await store.put("whole.mp4", data, "video/mp4")
    for _ in range(3):
        assert await _read(store, put.uri) == data
    # no consumer per read (nats-py's get leaves one behind each time, until the stream's consumer limit refuses reads)
    assert (await backends.bus.js.stream_info(f"OBJ_{RESULTS_BUCKET}")).state.consumer_count == 0
    empty = await store.put("empty.mp4", b"", "video/mp4")
    assert await _read(store, empty.uri) == b""
    replaced = os.urandom(1000)
    # the old chunks skipped
    assert await _read(store, (await store.put("whole.mp4", replaced, "video/mp4")).uri) == replaced
    await store.delete(put.uri)
    with pytest.raises(results.ResultNotFound):
        await _read(store, put.uri)


async def test_a_read_whose_chunks_are_gone_ends_at_once_and_leaves_nothing_subscribed(backends: Backends) -> None:
    store = results.ObjectStoreResults(backends.bus, stall_seconds=30)
    put = await store.put("gone.mp4", os.urandom(2 * results.CHUNK), "video/mp4")
    handle = await backends.bus.js.object_store(RESULTS_BUCKET)
    info = await handle.get_info("gone.mp4")
    # the object's description stays, its chunks go: nats-py's get would wait for them for ever
    await backends.bus.js.purge_stream(f"OBJ_{RESULTS_BUCKET}", subject=f"$O.{RESULTS_BUCKET}.C.{info.nuid}")
    subscriptions = len(backends.bus.nc._subs)
    began = time.monotonic()
    with pytest.raises(results.ResultNotFound, match="then no more chunks"):
        await asyncio.wait_for(_read(store, put.uri), 20)
    assert time.monotonic() - began < 5
    assert len(backends.bus.nc._subs) == subscriptions


async def test_a_server_that_stops_answering_fails_a_read_retryably_within_the_stall_limit(tmp_path: Path) -> None:
    server = EmbeddedNats(tmp_path / "nats").start()
    bus = await busmod.connect(server.url, "stall-test")
    try:
        await bus.js.create_object_store(RESULTS_BUCKET)
        store = results.ObjectStoreResults(bus, stall_seconds=0.5)
        put = await store.put("paused.mp4", os.urandom(2 * results.CHUNK), "video/mp4")
        assert server.proc is not None
        server.proc.send_signal(signal.SIGSTOP)  # alive, connected, silent
        try:
            began = time.monotonic()
            with pytest.raises(results.ResultStoreUnavailable, match=r"within 0\.5 s"):
                await asyncio.wait_for(_read(store, put.uri), 20)
            assert time.monotonic() - began < 5
        finally:
            server.proc.send_signal(signal.SIGCONT)
    finally:
        await bus.close()
        server.stop()
