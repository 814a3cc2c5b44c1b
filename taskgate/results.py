"""Where task outputs are kept: a JetStream object store bucket by default, a folder as an option.

An S3 store would implement the same ResultStore protocol.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from nats.js.errors import NotFoundError, ObjectNotFoundError
from nats.js.object_store import ObjectStore

from taskgate import bus as busmod
from taskgate.config import Settings

CHUNK = 256 * 1024


@dataclass(frozen=True, slots=True)
class StoredResult:
    """What the task row records about an output."""

    uri: str
    content_type: str
    size: int
    sha256: str


class ResultStore(Protocol):
    """Stores, streams and deletes outputs by URI."""

    async def put(self, name: str, data: bytes, content_type: str) -> StoredResult: ...

    def read(self, uri: str) -> AsyncIterator[bytes]: ...

    async def delete(self, uri: str) -> None: ...


class ResultNotFound(Exception):
    """The URI names nothing (deleted, or another store)."""


class ObjectStoreResults:
    """Outputs in the JetStream object store bucket `taskgate-results`: uri nats-os://<bucket>/<name>."""

    def __init__(self, bus: busmod.Bus, bucket: str = busmod.RESULTS_BUCKET) -> None:
        self._bus = bus
        self._bucket = bucket
        self._handle: ObjectStore | None = None

    async def _store(self) -> ObjectStore:
        if self._handle is None:  # looked up once: the lookup is a round trip per call otherwise
            self._handle = await self._bus.js.object_store(self._bucket)
        return self._handle

    async def put(self, name: str, data: bytes, content_type: str) -> StoredResult:
        store = await self._store()
        await store.put(name, data)
        return StoredResult(f"nats-os://{self._bucket}/{name}", content_type, len(data), hashlib.sha256(data).hexdigest())

    def _name(self, uri: str) -> str:
        prefix = f"nats-os://{self._bucket}/"
        if not uri.startswith(prefix):
            raise ResultNotFound(uri)
        return uri[len(prefix) :]

    async def read(self, uri: str) -> AsyncIterator[bytes]:
        store = await self._store()
        try:
            result = await store.get(self._name(uri))
        except (ObjectNotFoundError, NotFoundError) as exc:
            raise ResultNotFound(uri) from exc
        data = result.data or b""
        for offset in range(0, len(data), CHUNK):
            yield data[offset : offset + CHUNK]

    async def delete(self, uri: str) -> None:
        store = await self._store()
        with contextlib.suppress(ObjectNotFoundError, NotFoundError):
            await store.delete(self._name(uri))


class FolderResults:
    """Outputs as files in a folder: uri file://<absolute path>."""

    def __init__(self, folder: Path) -> None:
        self._folder = folder.resolve()
        self._folder.mkdir(parents=True, exist_ok=True)

    async def put(self, name: str, data: bytes, content_type: str) -> StoredResult:
        path = self._folder / name
        tmp = path.with_suffix(path.suffix + ".tmp")
        await asyncio.to_thread(tmp.write_bytes, data)
        await asyncio.to_thread(tmp.replace, path)  # readers never see half a file
        return StoredResult(f"file://{path}", content_type, len(data), hashlib.sha256(data).hexdigest())

    def _path(self, uri: str) -> Path:
        if not uri.startswith("file://"):
            raise ResultNotFound(uri)
        path = Path(uri[len("file://") :]).resolve()
        if path.parent != self._folder:
            raise ResultNotFound(uri)
        return path

    async def read(self, uri: str) -> AsyncIterator[bytes]:
        path = self._path(uri)
        try:
            handle = await asyncio.to_thread(path.open, "rb")
        except FileNotFoundError as exc:
            raise ResultNotFound(uri) from exc
        with handle:
            while chunk := await asyncio.to_thread(handle.read, CHUNK):
                yield chunk

    async def delete(self, uri: str) -> None:
        self._path(uri).unlink(missing_ok=True)


def result_store(settings: Settings, bus: busmod.Bus) -> ResultStore:
    """The store the settings choose."""
    if settings.result_store == "fs":
        return FolderResults(settings.result_dir or settings.state_dir / "results")
    return ObjectStoreResults(bus)
