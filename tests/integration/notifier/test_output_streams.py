"""WatchTask with include_output: a task's partial output, in order, resumable, ended by the terminal event (real
PostgreSQL, NATS JetStream and gRPC; chunks published as the worker publishes them, taskgate.output.publish)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import grpc
import pytest

from taskgate import bus as busmod
from taskgate import output
from taskgate.config import Settings
from taskgate.runtime import Backends
from taskgate.states import Status
from taskgate_api.v1 import events_pb2, task_pb2
from tests.support.factories import insert_task
from tests.support.harness import bearer, wait_for
from tests.support.notifier import TENANT, all_relayed, events_stub, fast, run_to, succeed

WORDS = ["Once ", "upon ", "a ", "time ", "there ", "was ", "a ", "tiny ", "model", "."]


def text(task_id: int, offset: int, piece: str, attempt: int = 1) -> output.Chunk:
    return output.Chunk(task_id=task_id, attempt=attempt, kind=output.TEXT, text=piece, offset=offset)


async def publish_words(backends: Backends, task_id: int, words: Sequence[str], offset: int = 0) -> int:
    """Publishes each word as a text chunk; answers the offset after the last."""
    for word in words:
        await output.publish(backends.bus, TENANT, text(task_id, offset, word))
        offset += len(word)
    return offset


def kinds(messages: Sequence[Any]) -> list[str]:
    return [m.WhichOneof("kind") for m in messages]


def chunks(messages: Sequence[Any]) -> list[task_pb2.OutputChunk]:
    return [m.output for m in messages if m.WhichOneof("kind") == "output"]


async def read_all(call: Any, within: float = 20.0) -> list[Any]:
    """Every message until the server ends the stream (keep-alives left out)."""
    got: list[Any] = []
    async with asyncio.timeout(within):
        while (msg := await call.read()) is not grpc.aio.EOF:
            if msg.WhichOneof("kind") != "keepalive":
                got.append(msg)
    return got


async def read_outputs(call: Any, count: int, within: float = 20.0) -> list[Any]:
    """Messages until `count` output chunks have come (keep-alives left out)."""
    got: list[Any] = []
    async with asyncio.timeout(within):
        while len(chunks(got)) < count:
            msg = await call.read()
            assert msg is not grpc.aio.EOF, "the stream ended early"
            if msg.WhichOneof("kind") != "keepalive":
                got.append(msg)
    return got


async def consumers(backends: Backends) -> int:
    return len(await backends.bus.js.consumers_info("TASK_OUTPUT"))


async def test_output_streams_in_order_once_each_and_the_stream_ends_after_the_terminal_event(
    backends: Backends, settings: Settings, api_key: str, notifier_factory: Any
) -> None:
    handle = await notifier_factory(fast(settings, stream_keepalive_seconds=60.0))  # no quiet-stream reads here
    pool = backends.pool
    task = await insert_task(pool)
    other = await insert_task(pool)
    await run_to(pool, task.id, Status.PROCESSING)
    offset = await publish_words(backends, task.id, WORDS[:3])  # before the stream: read from the stream
    async with events_stub(handle) as stub:
        call = stub.WatchTask(
            events_pb2.WatchTaskRequest(task_id=str(task.id), include_output=True), metadata=bearer(api_key)
        )
        first = await read_outputs(call, 3)
        assert kinds(first)[0] == "snapshot" and first[0].snapshot.status == task_pb2.TASK_STATUS_PROCESSING
        assert handle.output_hub.followed == 1
        offset = await publish_words(backends, task.id, WORDS[3:6], offset)
        first += await read_outputs(call, 3, within=5.0)  # live: as stored, not at the end or at a keep-alive
        await output.publish(backends.bus, TENANT, text(other.id, 0, "not this task's"))
        repeated = text(task.id, offset - len(WORDS[5]), WORDS[5])
        await output.publish(backends.bus, TENANT, repeated)  # a retried publish: stored once (Nats-Msg-Id)
        offset = await publish_words(backends, task.id, WORDS[6:], offset)
        await succeed(pool, task.id)
        rest = await read_all(call)
        assert await call.code() == grpc.StatusCode.OK
    got = first + rest
    sent = chunks(got)
    assert "".join(c.text for c in sent) == "".join(WORDS)
    assert [c.offset for c in sent] == [sum(len(w) for w in WORDS[:i]) for i in range(len(WORDS))]
    sequences = [c.sequence for c in sent]
    assert sequences == sorted(set(sequences)) and all(c.task_id == str(task.id) and c.attempt == 1 for c in sent)
    # the terminal event is the last message, after every chunk
    assert kinds(got)[-1] == "event" and got[-1].event.to_status == task_pb2.TASK_STATUS_SUCCEEDED
    assert max(i for i, k in enumerate(kinds(got)) if k == "output") < len(got) - 1
    # nothing left behind: the task's subscription is gone, no JetStream consumer was ever made
    await wait_for(lambda: handle.output_hub.followed == 0)
    assert await consumers(backends) == 0


async def test_a_stream_resumed_with_after_output_sequence_misses_nothing_and_repeats_nothing(
    backends: Backends, settings: Settings, api_key: str, notifier_factory: Any
) -> None:
    handle = await notifier_factory(fast(settings))
    pool = backends.pool
    task = await insert_task(pool)
    await run_to(pool, task.id, Status.PROCESSING)
    words = [f"w{i} " for i in range(60)]
    offset = await publish_words(backends, task.id, words[:10])
    async with events_stub(handle) as stub:
        call = stub.WatchTask(
            events_pb2.WatchTaskRequest(task_id=str(task.id), include_output=True), metadata=bearer(api_key)
        )
        before = await read_outputs(call, 10)
        offset = await publish_words(backends, task.id, words[10:15], offset)
        before += await read_outputs(call, 3)
        call.cancel()  # the connection drops mid-way
    version = max(m.snapshot.version if m.WhichOneof("kind") == "snapshot" else m.event.version for m in before)
    last_sequence = chunks(before)[-1].sequence
    offset = await publish_words(backends, task.id, words[15:30], offset)  # while nobody listens

    async def more() -> None:  # keeps chunks coming while the resumed stream reads what it missed and joins live
        next_offset = await publish_words(backends, task.id, words[30:], offset)
        assert next_offset == sum(len(w) for w in words)
        await succeed(pool, task.id)

    async with events_stub(handle) as stub:
        call = stub.WatchTask(
            events_pb2.WatchTaskRequest(
                task_id=str(task.id), include_output=True, after_version=version, after_output_sequence=last_sequence
            ),
            metadata=bearer(api_key),
        )
        producer = asyncio.create_task(more())
        after = await read_all(call)
        await producer
    assert "snapshot" not in kinds(after)
    every = chunks(before) + chunks(after)
    assert "".join(c.text for c in every) == "".join(words)  # nothing missed, nothing repeated
    assert [c.sequence for c in every] == sorted({c.sequence for c in every})
    assert after[-1].event.to_status == task_pb2.TASK_STATUS_SUCCEEDED


async def test_a_finished_task_sends_its_snapshot_then_its_output_then_ends(
    backends: Backends, settings: Settings, api_key: str, notifier_factory: Any
) -> None:
    handle = await notifier_factory(fast(settings))
    pool = backends.pool
    task = await insert_task(pool)
    await run_to(pool, task.id, Status.PROCESSING)
    await publish_words(backends, task.id, WORDS)
    await succeed(pool, task.id)
    await all_relayed(pool)
    async with events_stub(handle) as stub:
        got = await read_all(stub.WatchTask(
            events_pb2.WatchTaskRequest(task_id=str(task.id), include_output=True), metadata=bearer(api_key)
        ))
        assert kinds(got) == ["snapshot"] + ["output"] * len(WORDS)
        assert got[0].snapshot.status == task_pb2.TASK_STATUS_SUCCEEDED
        # from its history: the events, the chunks before the terminal one
        replay = await read_all(stub.WatchTask(
            events_pb2.WatchTaskRequest(task_id=str(task.id), include_output=True, after_version=1),
            metadata=bearer(api_key),
        ))
        assert kinds(replay) == ["event", "event"] + ["output"] * len(WORDS) + ["event"]
        # a stream that did not ask for output gets none
        plain = await read_all(
            stub.WatchTask(events_pb2.WatchTaskRequest(task_id=str(task.id)), metadata=bearer(api_key))
        )
        assert kinds(plain) == ["snapshot"]
        tail = await read_all(stub.WatchTask(
            events_pb2.WatchTaskRequest(
                task_id=str(task.id), include_output=True, after_output_sequence=chunks(got)[6].sequence
            ),
            metadata=bearer(api_key),
        ))
    assert "".join(c.text for c in chunks(tail)) == "".join(WORDS[7:])
    assert "".join(c.text for c in chunks(got)) == "".join(c.text for c in chunks(replay)) == "".join(WORDS)


async def test_negative_after_output_sequence_is_refused_naming_the_field(
    backends: Backends, settings: Settings, api_key: str, notifier_factory: Any
) -> None:
    handle = await notifier_factory(fast(settings))
    task = await insert_task(backends.pool)
    async with events_stub(handle) as stub:
        call = stub.WatchTask(
            events_pb2.WatchTaskRequest(task_id=str(task.id), include_output=True, after_output_sequence=-1),
            metadata=bearer(api_key),
        )
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await call.read()
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "after_output_sequence" in (caught.value.details() or "")
    assert handle.output_hub.followed == 0


async def test_a_chunk_the_live_subject_never_brought_is_read_when_the_next_one_shows_the_gap(
    backends: Backends, settings: Settings, api_key: str, notifier_factory: Any
) -> None:
    """A republished chunk lost on the way (a NATS reconnect drops core messages): the next one's previous sequence
    shows the gap and the stream reads the missing chunk from the stream, before the next, without a keep-alive."""
    handle = await notifier_factory(fast(settings, stream_keepalive_seconds=60.0))
    pool = backends.pool
    task = await insert_task(pool)
    await run_to(pool, task.id, Status.PROCESSING)
    async with events_stub(handle) as stub:
        call = stub.WatchTask(
            events_pb2.WatchTaskRequest(task_id=str(task.id), include_output=True), metadata=bearer(api_key)
        )
        offset = await publish_words(backends, task.id, WORDS[:2])
        got = await read_outputs(call, 2)  # the stream has caught up and follows the live subject
        assert handle.output_hub.followed == 1
        follow = next(iter(handle.output_hub._follows.values()))  # the loss is staged on the task's subscription
        await follow.subscription.unsubscribe()
        offset = await publish_words(backends, task.id, WORDS[2:4], offset)  # republished to nobody: lost here
        follow.subscription = await backends.bus.nc.subscribe(
            busmod.output_live_subject(TENANT, task.id), cb=handle.output_hub._deliver(task.id, follow)
        )
        await backends.bus.nc.flush()
        await publish_words(backends, task.id, WORDS[4:5], offset)
        got += await read_outputs(call, 3, within=5.0)
        call.cancel()
    assert "".join(c.text for c in chunks(got)) == "".join(WORDS[:5])
