"""The client SDK against the real services over gRPC, PostgreSQL and NATS (the test plays the worker)."""

from __future__ import annotations

import asyncio
import hashlib
import subprocess
import uuid
from pathlib import Path

import grpc
import pytest

from services.notifier import service as notifier_service
from services.submit import service as submit_service
from taskgate import auth, output, store
from taskgate.config import Settings
from taskgate.results import result_store
from taskgate.runtime import Backends
from taskgate_client import (
    AsyncTaskgateClient,
    FailedPrecondition,
    IntegrityError,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Status,
    TaskEvent,
    TextDelta,
    Unauthenticated,
    Unavailable,
    WaitTimeout,
    connect,
    connect_async,
)
from taskgate_client.config import sibling_address
from taskgate_local.embedded import free_port
from tests.support.factories import claimed
from tests.support.harness import wait_for
from tests.support.stacks import SMALL, Stack, run_task, run_task_finish

# -- submit, get, list, cancel -------------------------------------------------------------------------------------


async def _queued(client: AsyncTaskgateClient, task_id: str) -> bool:
    return (await client.get(task_id)).status is Status.QUEUED


async def test_submit_get_and_list(client: AsyncTaskgateClient) -> None:
    task = await client.submit(
        "a red fox in the snow", frames=9, width=32, height=32, steps=2, seed=7, metadata={"job": "1"}
    )
    assert task.status in (Status.QUEUED, Status.CREATED)
    assert task.created is True
    assert str(uuid.UUID(task.idempotency_key)) == task.idempotency_key  # generated once per call
    assert task.params["num_frames"] == 9 and task.params["seed"] == 7
    await wait_for(lambda: _queued(client, task.task_id))  # the dispatcher queues it after the answer
    fetched = await client.get(task.task_id)
    assert (
        fetched.task_id == task.task_id
        and fetched.metadata == {"job": "1"}
        and fetched.prompt == "a red fox in the snow"
    )
    assert fetched.status is Status.QUEUED and fetched.queue_position == 1
    assert [t.task_id async for t in client.list()] == [task.task_id]


async def test_same_idempotency_key_returns_the_same_task(client: AsyncTaskgateClient) -> None:
    first = await client.submit("same request", idempotency_key="order-42", **SMALL)  # type: ignore[arg-type]
    again = await client.submit("same request", idempotency_key="order-42", **SMALL)  # type: ignore[arg-type]
    other = await client.submit("same request", **SMALL)  # type: ignore[arg-type]
    assert again.task_id == first.task_id and again.created is False
    assert other.task_id != first.task_id and other.created is True


async def test_list_iterates_pages_and_filters(stack: Stack, client: AsyncTaskgateClient) -> None:
    ids = [(await client.submit(f"prompt {i}", **SMALL)).task_id for i in range(5)]  # type: ignore[arg-type]
    for task_id in ids:
        await wait_for(lambda: _queued(client, task_id))  # noqa: B023 - awaited at once; the dispatcher queues after the answer
    await client.cancel(ids[0])
    listed = [t.task_id async for t in client.list(page_size=2)]
    assert listed == list(reversed(ids))  # newest first, across three pages
    assert [t.task_id async for t in client.list("CANCELED", page_size=2)] == [ids[0]]
    assert [t.task_id async for t in client.list([Status.QUEUED], page_size=2)] == list(reversed(ids[1:]))


async def test_cancel_soft_and_hard(stack: Stack, client: AsyncTaskgateClient) -> None:
    queued = await client.submit("cancel me", **SMALL)  # type: ignore[arg-type]
    canceled = await client.cancel(queued.task_id)
    assert canceled.status is Status.CANCELED and canceled.terminal
    running = await client.submit("cancel me hard", **SMALL)  # type: ignore[arg-type]
    await claimed(stack.backends.pool, int(running.task_id), worker_id="w")
    hard = await client.cancel(running.task_id, hard=True)
    assert hard.status is Status.CANCELED
    mode = await stack.backends.pool.fetchval("SELECT cancel_mode FROM task WHERE id = $1", int(running.task_id))
    assert mode == "hard"
    assert (await client.cancel(queued.task_id)).status is Status.CANCELED  # idempotent
    done = await client.submit("already finished", **SMALL)  # type: ignore[arg-type]
    await run_task(stack.backends, done.task_id)
    with pytest.raises(FailedPrecondition) as info:
        await client.cancel(done.task_id)
    assert info.value.reason == "TASK_FINISHED"


# -- typed errors --------------------------------------------------------------------------------------------------


async def test_errors_are_typed_with_their_details(stack: Stack, client: AsyncTaskgateClient) -> None:
    with pytest.raises(NotFound) as missing:
        await client.get("123456789")
    assert missing.value.code is grpc.StatusCode.NOT_FOUND and missing.value.reason == "NOT_FOUND"

    with pytest.raises(InvalidArgument) as bad:
        await client.submit("bad sizes", frames=8, width=33, height=32)
    fields = {v.field for v in bad.value.field_violations}
    assert {"params.num_frames", "params.width"} <= fields, fields

    async with stack.client(api_key="tg_not-a-key") as stranger:
        with pytest.raises(Unauthenticated):
            await stranger.get("1")

    with pytest.raises(PermissionDenied):
        async with stack.client(admin_key=stack.api_key) as not_admin:
            await not_admin.stats()

    limited = await stack.key("tenant-limited", submits_per_minute=1)
    async with stack.client(api_key=limited) as c:
        await c.submit("one", **SMALL)  # type: ignore[arg-type]
        with pytest.raises(ResourceExhausted) as slow_down:
            await c.submit("two", **SMALL)  # type: ignore[arg-type]
    assert slow_down.value.reason and slow_down.value.retry_delay is not None and slow_down.value.retry_delay > 0


async def test_unavailable_is_retried_until_the_gateway_is_up(
    stack: Stack, settings: Settings, backends: Backends
) -> None:
    port = free_port()
    async with stack.client(address=f"127.0.0.1:{port}", retry_attempts=50) as c:
        call = asyncio.create_task(c.submit("retried", idempotency_key="retry-1", **SMALL))  # type: ignore[arg-type]
        await wait_for(lambda: c.retries >= 1)  # at least one attempt failed with UNAVAILABLE
        late = await submit_service.start(settings.model_copy(update={"submit_port": port}), backends)
        try:
            task = await asyncio.wait_for(call, 30)
        finally:
            await late.stop(0)
    assert task.created is True and task.idempotency_key == "retry-1"


async def test_retries_are_bounded(stack: Stack) -> None:
    async with stack.client(address=f"127.0.0.1:{free_port()}", retry_attempts=3) as c:
        with pytest.raises(Unavailable):
            await c.get("1")
        assert c.retries == 2


# -- watch, wait, download -----------------------------------------------------------------------------------------


async def watching(client: AsyncTaskgateClient, task_id: str) -> tuple[list[TaskEvent], asyncio.Task[None]]:
    """Watches a task in the background until its stream ends; returns once the first event (the snapshot) is in."""
    seen: list[TaskEvent] = []

    async def collect() -> None:
        async for event in client.watch(task_id):
            seen.append(event)

    watcher = asyncio.create_task(collect())
    await wait_for(lambda: len(seen) >= 1)
    return seen, watcher


async def test_watch_yields_snapshot_then_every_version_until_terminal(
    stack: Stack, client: AsyncTaskgateClient
) -> None:
    task = await client.submit("watch me", **SMALL)  # type: ignore[arg-type]
    await wait_for(lambda: _queued(client, task.task_id))  # the snapshot below is QUEUED, not the answer's CREATED
    seen, watcher = await watching(client, task.task_id)
    await run_task(stack.backends, task.task_id, progress=(25, 75))
    await asyncio.wait_for(watcher, 10)
    assert seen[0].snapshot and seen[0].status is Status.QUEUED
    versions = [e.version for e in seen]
    assert versions == list(range(versions[0], versions[0] + len(seen)))
    assert [e.status for e in seen[1:]] == [Status.PROCESSING] * 3 + [Status.SUCCEEDED]
    assert [e.progress for e in seen[2:4]] == [25, 75]
    assert seen[-1].terminal and seen[-1].result is not None


async def test_watch_resumes_after_the_notifier_restarts(stack: Stack, client: AsyncTaskgateClient) -> None:
    task = await client.submit("survive a restart", **SMALL)  # type: ignore[arg-type]
    seen, watcher = await watching(client, task.task_id)
    tid = int(task.task_id)
    await claimed(stack.backends.pool, tid, worker_id="w")
    await wait_for(lambda: len(seen) >= 2)
    await stack.notifier.kill()  # the stream drops mid-task
    # Events the client cannot see while the notifier is down.
    for pct in (30, 60):
        await store.progress(stack.backends.pool, tid, attempt=1, percent=pct, lease_seconds=30.0, actor="worker")
    stack.notifier = await notifier_service.start(stack.settings)
    await run_task_finish(stack.backends, task.task_id, attempt=1)
    await asyncio.wait_for(watcher, 20)
    versions = [e.version for e in seen]
    assert versions == list(range(versions[0], versions[0] + len(seen))), versions  # no gap, no repeat
    assert [e.progress for e in seen if e.status is Status.PROCESSING][1:] == [30, 60]
    assert seen[-1].status is Status.SUCCEEDED




async def test_watch_after_the_end_returns_nothing_more(stack: Stack, client: AsyncTaskgateClient) -> None:
    task = await client.submit("already done", **SMALL)  # type: ignore[arg-type]
    await run_task(stack.backends, task.task_id)
    final = await client.get(task.task_id)
    assert [e async for e in client.watch(task.task_id, after_version=final.version)] == []
    history = [e async for e in client.watch(task.task_id, after_version=final.version - 1)]
    assert [(e.version, e.status) for e in history] == [(final.version, Status.SUCCEEDED)]


async def test_wait_follows_the_stream(stack: Stack, client: AsyncTaskgateClient) -> None:
    task = await client.submit("wait for me", **SMALL)  # type: ignore[arg-type]
    events: list[TaskEvent] = []
    waiting = asyncio.create_task(client.wait(task.task_id, 20, on_event=events.append))
    await wait_for(lambda: len(events) >= 1)
    await run_task(stack.backends, task.task_id)
    final = await waiting
    assert final.status is Status.SUCCEEDED and final.result is not None
    assert events[-1].status is Status.SUCCEEDED


async def test_wait_polls_when_the_event_stream_is_unreachable(stack: Stack) -> None:
    async with stack.client(events_address=f"127.0.0.1:{free_port()}") as c:
        task = await c.submit("no notifier", **SMALL)  # type: ignore[arg-type]
        events: list[TaskEvent] = []
        waiting = asyncio.create_task(c.wait(task.task_id, 30, on_event=events.append))
        await wait_for(lambda: len(events) >= 1)  # a polled snapshot: the stream was given up
        assert events[0].snapshot
        await run_task(stack.backends, task.task_id, result=None)
        final = await waiting
    assert final.status is Status.FAILED and final.error_code == "BOOM"


async def test_wait_times_out(client: AsyncTaskgateClient) -> None:
    task = await client.submit("never runs", **SMALL)  # type: ignore[arg-type]
    with pytest.raises(WaitTimeout) as info:
        await client.wait(task.task_id, 0.3)
    assert info.value.task_id == task.task_id


async def test_download_verifies_the_checksum(stack: Stack, client: AsyncTaskgateClient, tmp_path: Path) -> None:
    payload = bytes(range(256)) * 4000  # ~1 MB: several chunks
    task = await client.submit("download me", **SMALL)  # type: ignore[arg-type]
    with pytest.raises(FailedPrecondition):
        await client.download(task.task_id, tmp_path / "early.mp4")
    assert not (tmp_path / "early.mp4").exists() and not (tmp_path / "early.mp4.part").exists()
    await run_task(stack.backends, task.task_id, result=payload)
    info = await client.download(task.task_id, tmp_path / "out.mp4")
    assert (tmp_path / "out.mp4").read_bytes() == payload
    assert info.sha256 == hashlib.sha256(payload).hexdigest() and info.size_bytes == len(payload)

    # The stored object changes behind the row's back: same size, other bytes.
    await result_store(stack.settings, stack.backends.bus).put(f"{task.task_id}-a1.mp4", payload[::-1], "video/mp4")
    with pytest.raises(IntegrityError) as bad:
        await client.download(task.task_id, tmp_path / "tampered.mp4")
    assert bad.value.reason == "CHECKSUM_MISMATCH"
    assert not (tmp_path / "tampered.mp4").exists() and not (tmp_path / "tampered.mp4.part").exists()


# -- admin ---------------------------------------------------------------------------------------------------------


async def test_admin_calls(stack: Stack, client: AsyncTaskgateClient) -> None:
    task = await client.submit("for the operators", **SMALL)  # type: ignore[arg-type]
    await wait_for(lambda: _queued(client, task.task_id))  # the dispatcher queues it after the answer
    stats = await client.stats()
    counts = {(c.model_id, c.status): c.count for c in stats.counts}
    assert counts[("wan-tiny", Status.QUEUED.to_proto())] == 1
    assert await client.stuck() == []
    batches = [b async for b in client.requeue([task.task_id], dry_run=True)]
    assert batches and all(b.dry_run for b in batches)
    assert [item.task_id for b in batches for item in b.items] == [task.task_id]
    assert [d async for d in client.dead_letters()] == []
    assert await client.redeliver(task.task_id) == []


# -- the blocking client -------------------------------------------------------------------------------------------


def _sync_session(stack: Stack) -> tuple[str, list[int], str, list[str]]:
    with connect(
        stack.address, stack.api_key, events_address=stack.events_address, admin_address=stack.admin_address
    ) as c:
        task = c.submit("from blocking code", **SMALL)  # type: ignore[arg-type]
        events = c.watch(task.task_id)
        # the dispatcher queues the task after the answer: the watch may open on the CREATED snapshot (v1), and then
        # streams the QUEUED move, which is awaited here (the cancel below is of a QUEUED task)
        first = next(e for e in events if e.status is not Status.CREATED)
        events.close()  # leaving a watch early closes its stream
        canceled = c.cancel(task.task_id)
        versions = [e.version for e in c.watch(task.task_id)]
        listed = [t.task_id for t in c.list(page_size=1)]
        with pytest.raises(NotFound):
            c.get("42")
        return task.task_id, [first.version, *versions], canceled.status.value, listed


async def test_blocking_client(stack: Stack) -> None:
    task_id, versions, status, listed = await asyncio.to_thread(_sync_session, stack)
    assert status == "CANCELED"
    assert versions[0] == 2 and versions[-1] == 3  # snapshot of QUEUED (v2), then the CANCELED snapshot (v3)
    assert listed == [task_id]


# -- configuration -------------------------------------------------------------------------------------------------


def test_sibling_addresses() -> None:
    assert sibling_address("gw.internal:443", 50052) == "gw.internal:50052"
    assert sibling_address("[::1]:50051", 50053) == "[::1]:50053"
    assert sibling_address("dns:///gw:50051", 50052) == "dns:///gw:50052"
    assert sibling_address("localhost", 50052) == "localhost:50052"
    c = connect_async("10.0.0.5:50051", "k")
    assert (c.config.events_address, c.config.admin_address) == ("10.0.0.5:50052", "10.0.0.5:50053")
    assert not c.config.tls


# -- TLS -----------------------------------------------------------------------------------------------------------


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_pki(folder: Path) -> Path:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, all signed by the CA (openssl CLI)."""
    folder.mkdir()
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
             "-subj", "/CN=taskgate test CA", cwd=folder)
    for name, ext in (
        ("server", "subjectAltName=IP:127.0.0.1,DNS:localhost"),
        ("client", "extendedKeyUsage=clientAuth"),
    ):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", f"/CN={name}", cwd=folder)
        (folder / f"{name}.ext").write_text(ext + "\n")
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.pem", "-days", "1", "-extfile", f"{name}.ext", cwd=folder)
    return folder


async def test_tls_and_mutual_tls(settings: Settings, backends: Backends, tmp_path: Path) -> None:
    pki = make_pki(tmp_path / "pki")
    api_key, _ = await auth.create_key(backends.pool, settings.api_key_pepper, "tenant-tls")
    mtls = settings.model_copy(
        update={
            "tls_cert_file": pki / "server.pem",
            "tls_key_file": pki / "server.key",
            "tls_client_ca_file": pki / "ca.pem",
        }
    )
    gateway = await submit_service.start(mtls, backends)
    address = f"127.0.0.1:{gateway.port}"
    try:
        async with connect_async(
            address,
            api_key,
            root_certificates=pki / "ca.pem",
            client_cert=pki / "client.pem",
            client_key=pki / "client.key",
        ) as c:
            assert c.config.tls
            task = await c.submit("over mutual TLS", **SMALL)  # type: ignore[arg-type]
            assert (await c.get(task.task_id)).prompt == "over mutual TLS"
        async with connect_async(
            address, api_key, root_certificates=(pki / "ca.pem").read_bytes(), retry_attempts=1
        ) as c:
            with pytest.raises(Unavailable):  # no client certificate: the handshake fails
                await c.get(task.task_id)
        async with connect_async(address, api_key, retry_attempts=1) as c:
            with pytest.raises(Unavailable):  # plaintext against TLS
                await c.get(task.task_id)
    finally:
        await gateway.stop(0)


async def test_stream_text_resumes_after_the_notifier_restarts_and_follows_a_new_attempt(
    stack: Stack, client: AsyncTaskgateClient
) -> None:
    """stream_text yields every delta once, in order, across a dropped stream; a newer attempt's first delta says it
    restarted the text; output() hands out the chunks themselves."""
    task = await client.submit("speak", **SMALL)  # type: ignore[arg-type]
    tid = int(task.task_id)
    await claimed(stack.backends.pool, tid, worker_id="w")
    bus = stack.backends.bus
    offset = 0

    async def say(*words: str, attempt: int = 1) -> None:
        nonlocal offset
        for word in words:
            await output.publish(bus, "tenant-a", output.Chunk(tid, attempt, output.TEXT, text=word, offset=offset))
            offset += len(word)

    deltas: list[TextDelta] = []

    async def read() -> None:
        async for delta in client.stream_text(task.task_id):
            deltas.append(delta)

    await say("Hello ", "there, ")
    reader = asyncio.create_task(read())
    await wait_for(lambda: len(deltas) == 2)
    await stack.notifier.kill()  # the stream drops mid-answer
    await say("dear ", "reader. ")  # while nobody can hear
    stack.notifier = await notifier_service.start(stack.settings)
    await wait_for(lambda: len(deltas) == 4, within=20)
    offset = 6  # a second attempt that kept "Hello " and says the rest anew
    await say("again.", attempt=2)
    await say("late words", attempt=1)  # the replaced worker's last chunk: dropped
    await run_task_finish(stack.backends, task.task_id, attempt=1)
    await asyncio.wait_for(reader, 20)
    assert [str(d) for d in deltas] == ["Hello ", "there, ", "dear ", "reader. ", "again."]
    assert [d.restarted for d in deltas] == [False] * 4 + [True] and (deltas[-1].attempt, deltas[-1].offset) == (2, 6)
    chunks = [c async for c in client.output(task.task_id)]
    assert [c.kind for c in chunks] == ["text"] * 6 and chunks == sorted(chunks, key=lambda c: c.sequence)
    later = [c async for c in (await client.get(task.task_id)).output(after_sequence=chunks[3].sequence)]
    assert [c.text for c in later] == ["again.", "late words"]
    # no inline answer (this task's result is a file): text() reads the result itself
    assert await (await client.get(task.task_id)).text() == "data"
