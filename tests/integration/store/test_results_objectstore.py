"""The JetStream object store as the result store: whole reads checked against the stored digest, and a read whose
chunks stop coming fails (retryable) instead of waiting for ever, as nats-py's own ObjectStore.get would."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from taskgate import results
from taskgate.bus import RESULTS_BUCKET
from taskgate.runtime import Backends


async def _read(store: results.ResultStore, uri: str) -> bytes:
    return b"".join([chunk async for chunk in store.read(uri)])


async def test_an_object_reads_back_whole_and_a_missing_one_is_not_found(backends: Backends) -> None:
    store = results.ObjectStoreResults(backends.bus, stall_seconds=5)
    data = os.urandom(3 * results.CHUNK + 17)  # several of the store's chunks, the last one short
    put = await store.put("whole.mp4", data, "video/mp4")
    assert await _read(store, put.uri) == data
    empty = await store.put("empty.mp4", b"", "video/mp4")
    assert await _read(store, empty.uri) == b""
    await store.delete(put.uri)
    with pytest.raises(results.ResultNotFound):
        await _read(store, put.uri)


async def test_a_read_whose_chunks_stop_coming_fails_retryably_within_the_stall_limit(backends: Backends) -> None:
    store = results.ObjectStoreResults(backends.bus, stall_seconds=0.5)
    put = await store.put("stalled.mp4", os.urandom(2 * results.CHUNK), "video/mp4")
    handle = await backends.bus.js.object_store(RESULTS_BUCKET)
    info = await handle.get_info("stalled.mp4")
    # the object's description stays, its chunks go: a reader is told of chunks that never arrive
    await backends.bus.js.purge_stream(f"OBJ_{RESULTS_BUCKET}", subject=f"$O.{RESULTS_BUCKET}.C.{info.nuid}")
    began = time.monotonic()
    with pytest.raises(results.ResultStoreUnavailable, match="no chunk for 0.5 s"):
        await asyncio.wait_for(_read(store, put.uri), 30)
    assert time.monotonic() - began < 10
    subscriptions = len(backends.bus.nc._subs)
    with pytest.raises(results.ResultStoreUnavailable):
        await _read(store, put.uri)
    assert len(backends.bus.nc._subs) == subscriptions  # a failed read leaves no subscription behind
