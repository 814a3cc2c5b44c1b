"""Where task outputs are kept: a JetStream object store bucket by default, a folder or an S3-compatible bucket as
options. Only the S3 store gives outputs a download URL (a presigned GET) that works without a gRPC client.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Protocol, TypeVar

import boto3
import nats.errors
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError
from nats.js.errors import NotFoundError, ObjectNotFoundError
from nats.js.object_store import OBJ_CHUNKS_PRE_TEMPLATE, OBJ_DIGEST_TYPE, ObjectStore

from taskgate import bus as busmod
from taskgate.config import CommonSettings
from taskgate_api.v1 import task_pb2

CHUNK = 256 * 1024
SHA256_KEY = "sha256"  # the object's user metadata key (x-amz-meta-sha256) holding the output's hex sha256
INLINE_PREFIX = "data:"  # an output small enough to be kept in its task's row: an RFC 2397 data URI, in no store
T = TypeVar("T")


def inline(data: bytes, content_type: str) -> StoredResult:
    """An output kept in its task's row instead of a store (worker setting result_inline_max_bytes): a base64 data URI
    that every store reads back, deletes (nothing to do) and links (no URL) like one of its own."""
    encoded = base64.b64encode(data).decode()
    return StoredResult(
        f"{INLINE_PREFIX}{content_type};base64,{encoded}", content_type, len(data), hashlib.sha256(data).hexdigest()
    )


def is_inline(uri: str) -> bool:
    """Whether `uri` holds its output itself (see inline)."""
    return uri.startswith(INLINE_PREFIX)


def inline_bytes(uri: str) -> bytes:
    """The output an inline URI holds; ResultNotFound for a URI that is not one or does not decode."""
    head, sep, body = uri.partition(",")
    if not is_inline(uri) or not sep or not head.endswith(";base64"):
        raise ResultNotFound(uri[:64])
    try:
        return base64.b64decode(body, validate=True)
    except ValueError as exc:
        raise ResultNotFound(uri[:64]) from exc


@dataclass(frozen=True, slots=True)
class StoredResult:
    """What the task row records about an output."""

    uri: str
    content_type: str
    size: int
    sha256: str


@dataclass(frozen=True, slots=True)
class ResultLink:
    """A download URL of an output and when it stops working."""

    url: str
    expires_at: datetime


class ResultStore(Protocol):
    """Stores, streams and deletes outputs by URI, and links to them where the store can."""

    async def put(self, name: str, data: bytes, content_type: str) -> StoredResult: ...

    def uri_of(self, name: str) -> str: ...

    def read(self, uri: str) -> AsyncIterator[bytes]: ...

    async def delete(self, uri: str) -> None: ...

    def link(self, uri: str) -> ResultLink | None: ...


class ResultNotFound(Exception):
    """The URI names nothing (deleted, or another store)."""


class ResultStoreUnavailable(OSError):
    """The store did not answer, or answered with a server error: retry later (an OSError, so a backend error)."""


class ObjectStoreResults:
    """Outputs in the JetStream object store bucket `taskgate-results`: uri nats-os://<bucket>/<name>."""

    def __init__(self, bus: busmod.Bus, bucket: str = busmod.RESULTS_BUCKET, *, stall_seconds: float = 30.0) -> None:
        self._bus = bus
        self._bucket = bucket
        self._stall = stall_seconds
        self._stream = f"OBJ_{bucket}"
        self._handle: ObjectStore | None = None

    async def _store(self) -> ObjectStore:
        if self._handle is None:  # looked up once: the lookup is a round trip per call otherwise
            self._handle = await self._bus.js.object_store(self._bucket)
        return self._handle

    def uri_of(self, name: str) -> str:
        return f"nats-os://{self._bucket}/{name}"

    async def put(self, name: str, data: bytes, content_type: str) -> StoredResult:
        store = await self._store()
        await store.put(name, data)
        return StoredResult(self.uri_of(name), content_type, len(data), hashlib.sha256(data).hexdigest())

    def _name(self, uri: str) -> str:
        prefix = f"nats-os://{self._bucket}/"
        if not uri.startswith(prefix):
            raise ResultNotFound(uri)
        return uri[len(prefix) :]

    async def read(self, uri: str) -> AsyncIterator[bytes]:
        """The object's bytes once its digest is checked, its chunks read one direct get at a time.

        Not nats-py's ObjectStore.get: it waits without bound for a chunk its ordered consumer does not receive (seen
        in CI: a worker's input read that never returned; its heartbeat check looks for a gap only once a first chunk
        has arrived). A direct get per chunk has no consumer to lose messages or clean up, and each is bounded: a
        chunk that does not come within `stall_seconds` (or the JetStream request timeout) raises
        ResultStoreUnavailable (retryable).
        """
        if is_inline(uri):
            yield inline_bytes(uri)
            return
        store = await self._store()
        try:
            info = await asyncio.wait_for(store.get_info(self._name(uri)), self._stall)
        except (ObjectNotFoundError, NotFoundError) as exc:
            raise ResultNotFound(uri) from exc
        except (TimeoutError, nats.errors.TimeoutError) as exc:
            raise ResultStoreUnavailable(f"{uri}: no description within {self._stall:g} s") from exc
        size = info.size or 0
        subject = OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=self._bucket, obj=info.nuid)
        data = bytearray()
        seq = 0
        while len(data) < size:
            try:
                chunk = await asyncio.wait_for(
                    self._bus.js.get_msg(self._stream, seq=seq + 1, subject=subject, direct=True, next=True),
                    self._stall,
                )
            except NotFoundError as exc:  # its description is there, its chunks are not (a delete under way)
                raise ResultNotFound(f"{uri}: {len(data)} of {size} bytes, then no more chunks") from exc
            except (TimeoutError, nats.errors.TimeoutError) as exc:
                raise ResultStoreUnavailable(
                    f"{uri}: no chunk within {self._stall:g} s ({len(data)} of {size} bytes read)"
                ) from exc
            seq = chunk.seq or seq + 1
            data += chunk.data or b""
        expected = base64.urlsafe_b64decode(
            (info.digest or "").replace(OBJ_DIGEST_TYPE, "").replace(OBJ_DIGEST_TYPE.upper(), "")
        )
        if len(data) != size or hashlib.sha256(data).digest() != expected:
            raise ResultStoreUnavailable(f"{uri}: read {len(data)} bytes that do not match the stored digest")
        for offset in range(0, len(data), CHUNK):
            yield bytes(data[offset : offset + CHUNK])

    async def delete(self, uri: str) -> None:
        if is_inline(uri):
            return
        store = await self._store()
        with contextlib.suppress(ObjectNotFoundError, NotFoundError):
            await store.delete(self._name(uri))

    def link(self, uri: str) -> ResultLink | None:
        """None: the object store is reachable only through GetTaskResult."""
        return None


class FolderResults:
    """Outputs as files in a folder (inputs in its subfolder): uri file://<absolute path>."""

    def __init__(self, folder: Path) -> None:
        self._folder = folder.resolve()
        self._folder.mkdir(parents=True, exist_ok=True)

    def uri_of(self, name: str) -> str:
        return f"file://{self._folder / name}"

    async def put(self, name: str, data: bytes, content_type: str) -> StoredResult:
        path = self._path(self.uri_of(name))
        tmp = path.with_suffix(path.suffix + ".tmp")
        await asyncio.to_thread(path.parent.mkdir, exist_ok=True)
        await asyncio.to_thread(tmp.write_bytes, data)
        await asyncio.to_thread(tmp.replace, path)  # readers never see half a file
        return StoredResult(f"file://{path}", content_type, len(data), hashlib.sha256(data).hexdigest())

    def _path(self, uri: str) -> Path:
        """The file of a URI: in the folder itself, or one level down (inputs/), never outside it."""
        if not uri.startswith("file://"):
            raise ResultNotFound(uri)
        path = Path(uri[len("file://") :]).resolve()
        if path.parent != self._folder and path.parent.parent != self._folder:
            raise ResultNotFound(uri)
        return path

    async def read(self, uri: str) -> AsyncIterator[bytes]:
        if is_inline(uri):
            yield inline_bytes(uri)
            return
        path = self._path(uri)
        try:
            handle = await asyncio.to_thread(path.open, "rb")
        except FileNotFoundError as exc:
            raise ResultNotFound(uri) from exc
        with handle:
            while chunk := await asyncio.to_thread(handle.read, CHUNK):
                yield chunk

    async def delete(self, uri: str) -> None:
        if not is_inline(uri):
            self._path(uri).unlink(missing_ok=True)

    def link(self, uri: str) -> ResultLink | None:
        """None: a local folder has no URL."""
        return None


def _s3_client(settings: CommonSettings, endpoint_url: str | None) -> Any:
    config = Config(
        signature_version="s3v4",
        s3={"addressing_style": settings.s3_addressing_style},
        retries={"mode": "standard", "max_attempts": 3},
        connect_timeout=5,
        read_timeout=settings.result_stall_seconds,
    )
    return boto3.session.Session().client(
        "s3",
        endpoint_url=endpoint_url,
        region_name=settings.s3_region,
        aws_access_key_id=settings.s3_access_key_id,
        aws_secret_access_key=settings.s3_secret_access_key,
        config=config,
    )


class S3Results:
    """Outputs in an S3-compatible bucket: uri s3://<bucket>/<key>, stored with their content type and sha256
    (object metadata `sha256`); links are presigned GET URLs valid for result_url_ttl_seconds."""

    def __init__(self, settings: CommonSettings) -> None:
        self._bucket = settings.s3_bucket
        self._prefix = settings.s3_prefix
        self._ttl = settings.result_url_ttl_seconds
        self._client = _s3_client(settings, settings.s3_endpoint_url)
        # presigning is local: a second client only puts the receivers' endpoint into the URL
        public = settings.s3_public_endpoint_url
        self._signer = _s3_client(settings, public) if public else self._client

    def _key(self, uri: str) -> str:
        prefix = f"s3://{self._bucket}/"
        if not uri.startswith(prefix):
            raise ResultNotFound(uri)
        return uri[len(prefix) :]

    async def _call(self, uri: str, call: Callable[[], T]) -> T:
        """Runs one blocking client call in a thread; a missing key is ResultNotFound, an outage
        ResultStoreUnavailable."""
        try:
            return await asyncio.to_thread(call)
        except ClientError as exc:
            code = str(exc.response.get("Error", {}).get("Code", ""))
            status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
            if code in ("NoSuchKey", "404", "NotFound"):
                raise ResultNotFound(uri) from exc
            if status >= 500 or code in ("SlowDown", "RequestTimeout"):
                raise ResultStoreUnavailable(f"S3 {code}") from exc
            raise
        except BotoCoreError as exc:
            raise ResultStoreUnavailable(f"S3 {type(exc).__name__}") from exc

    def uri_of(self, name: str) -> str:
        return f"s3://{self._bucket}/{self._prefix}{name}"

    async def put(self, name: str, data: bytes, content_type: str) -> StoredResult:
        key = self._prefix + name
        uri = self.uri_of(name)
        sha256 = hashlib.sha256(data).hexdigest()
        await self._call(uri, lambda: self._client.put_object(
            Bucket=self._bucket, Key=key, Body=data, ContentType=content_type, Metadata={SHA256_KEY: sha256}
        ))
        return StoredResult(uri, content_type, len(data), sha256)

    async def read(self, uri: str) -> AsyncIterator[bytes]:
        if is_inline(uri):
            yield inline_bytes(uri)
            return
        key = self._key(uri)
        response = await self._call(uri, lambda: self._client.get_object(Bucket=self._bucket, Key=key))
        body = response["Body"]
        try:
            while chunk := await self._call(uri, lambda: body.read(CHUNK)):
                yield chunk
        finally:
            body.close()

    async def delete(self, uri: str) -> None:
        if is_inline(uri):
            return
        key = self._key(uri)
        await self._call(uri, lambda: self._client.delete_object(Bucket=self._bucket, Key=key))

    def link(self, uri: str) -> ResultLink | None:
        """A presigned GET URL of the output (signing is local: no request is made)."""
        try:
            key = self._key(uri)
        except ResultNotFound:
            return None  # an output of another store, from before a switch
        expires_at = datetime.now(UTC) + timedelta(seconds=self._ttl)
        url = self._signer.generate_presigned_url(
            "get_object", Params={"Bucket": self._bucket, "Key": key}, ExpiresIn=int(self._ttl)
        )
        return ResultLink(url, expires_at)


def result_store(settings: CommonSettings, bus: busmod.Bus) -> ResultStore:
    """The store the settings choose."""
    if settings.result_store == "fs":
        return FolderResults(settings.result_dir or settings.state_dir / "results")
    if settings.result_store == "s3":
        return S3Results(settings)
    return ObjectStoreResults(bus, stall_seconds=settings.result_stall_seconds)


def add_link(store: ResultStore, result: task_pb2.TaskResult) -> None:
    """Fills a wire TaskResult's url and url_expires_at when its output has a download URL (and still exists)."""
    if not result.uri or result.HasField("deleted_at"):
        return
    link = store.link(result.uri)
    if link is not None:
        result.url = link.url
        result.url_expires_at.FromDatetime(link.expires_at)


def linked_event(store: ResultStore, event: task_pb2.TaskEvent) -> task_pb2.TaskEvent:
    """The event with a download URL in its result (a copy: the hub shares one message among streams)."""
    if not event.result.uri:
        return event
    out = task_pb2.TaskEvent()
    out.CopyFrom(event)
    add_link(store, out.result)
    return out
