"""taskgate_client.testing: the fake behaves like the real services on the documented cases.

Each scenario runs twice, once against the fake and once against the real services (the test plays the worker), and
asserts the same literal expectations both times.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from PIL import Image

from taskgate import store
from taskgate.config import ModelSpec, Settings
from taskgate.results import result_store
from taskgate.runtime import Backends
from taskgate_client import (
    AlreadyExists,
    AsyncTaskgateClient,
    AsyncTaskHandle,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Status,
    Task,
    TaskEvent,
    TaskFailed,
    TaskgateError,
)
from taskgate_client.aio import INLINE_IMAGE_BYTES
from taskgate_client.testing import (
    Fail,
    FakeAsyncTaskgateClient,
    FakeTaskgate,
    FakeTaskgateClient,
    StayQueued,
    Succeed,
    TimeOut,
)
from tests.support.factories import claimed
from tests.support.harness import wait_for
from tests.support.stacks import SMALL, Stack

PAYLOAD = bytes(range(256)) * 700  # ~180 KB: several chunks
I2V_MODEL = "sleepy-i2v"
Play = Callable[[str, Succeed | Fail], Awaitable[None]]


@dataclass
class Backend:
    """A client and a way to play the worker for one of its tasks."""

    client: AsyncTaskgateClient
    play: Play
    tmp: Path


async def play_real(backends: Backends, task_id: str, outcome: Succeed | Fail) -> None:
    """The worker's moves in the real store: claim, progress, then succeed or fail."""
    tid = int(task_id)
    attempt = (await claimed(backends.pool, tid, worker_id="test-worker")).attempt
    for pct in outcome.progress:
        await store.progress(backends.pool, tid, attempt=attempt, percent=pct, lease_seconds=30.0, actor="worker")
    if isinstance(outcome, Fail):
        error = store.TaskError(outcome.code, outcome.message)
        out = await store.fail(backends.pool, tid, error=error, actor="worker", reason="failed", attempt=attempt)
    else:
        assert outcome.data is not None
        stored = await result_store(backends.settings, backends.bus).put(
            f"{task_id}-a{attempt}.mp4", outcome.data, "video/mp4"
        )
        ref = store.ResultRef(stored.uri, stored.content_type, stored.size, stored.sha256)
        out = await store.succeed(backends.pool, tid, attempt=attempt, result=ref, actor="worker")
    assert out.task is not None


@pytest.fixture
def settings(settings: Settings) -> Settings:
    """The test settings with an image-to-video model, as the fake serves one."""
    i2v = ModelSpec(kind="sleep", task_types=["image-to-video"])
    return settings.model_copy(update={"models": {**settings.models, I2V_MODEL: i2v}})


# -- the scenarios -------------------------------------------------------------------------------------------------


async def lifecycle(b: Backend) -> None:
    """States, versions, queue positions, the event stream, wait, download and list."""
    c = b.client
    task = await c.submit("a red fox", frames=9, width=32, height=32, steps=2, seed=7, metadata={"job": "1"})
    assert isinstance(task, AsyncTaskHandle) and isinstance(task, Task)
    # the answer follows the admission commit; the dispatcher queues the task after it
    assert (task.status, task.version, task.queue_position, task.created) == (Status.CREATED, 1, 0, True)
    queued = await dispatched(task)
    assert (queued.status, queued.version, queued.queue_position) == (Status.QUEUED, 2, 1)
    assert task.params["num_frames"] == 9 and task.params["seed"] == 7 and task.metadata == {"job": "1"}
    seen: list[TaskEvent] = []

    async def follow() -> None:
        async for event in task.events():
            seen.append(event)

    watcher = asyncio.create_task(follow())
    await wait_for(lambda: len(seen) >= 1)
    await b.play(task.task_id, Succeed(PAYLOAD, progress=(25, 75)))
    await asyncio.wait_for(watcher, 10)
    assert [(e.version, e.status, e.progress, e.snapshot) for e in seen] == [
        (2, Status.QUEUED, 0, True),
        (3, Status.PROCESSING, 0, False),
        (4, Status.PROCESSING, 25, False),
        (5, Status.PROCESSING, 75, False),
        (6, Status.SUCCEEDED, 100, False),
    ]
    done = await task.wait(10)
    assert (done.status, done.version, done.attempt) == (Status.SUCCEEDED, 6, 1)
    assert done.result is not None and done.result.sha256 == hashlib.sha256(PAYLOAD).hexdigest()
    info = await done.download(b.tmp / "out.mp4")
    assert (b.tmp / "out.mp4").read_bytes() == PAYLOAD and info.size_bytes == len(PAYLOAD)
    second = await dispatched(await c.submit("second", **SMALL))  # type: ignore[arg-type]
    third = await dispatched(await c.submit("third", **SMALL))  # type: ignore[arg-type]
    assert (second.queue_position, third.queue_position) == (1, 2)
    assert [t.task_id async for t in c.list(page_size=1)] == [third.task_id, second.task_id, task.task_id]
    assert [t.task_id async for t in c.list("SUCCEEDED")] == [task.task_id]
    assert (await third.refresh()).queue_position == 2


async def dispatched(task: AsyncTaskHandle) -> AsyncTaskHandle:
    """The task once the dispatcher has queued it (at once in the fake, one pass after the answer for real)."""
    await wait_for(lambda: _is_queued(task))
    return await task.refresh()


async def _is_queued(task: AsyncTaskHandle) -> bool:
    return (await task.refresh()).status is Status.QUEUED


async def errors(b: Backend) -> None:
    """The typed errors and their reasons."""
    c = b.client
    with pytest.raises(NotFound) as missing:
        await c.get("123456789")
    assert missing.value.reason == "NOT_FOUND"
    with pytest.raises(InvalidArgument) as not_an_id:
        await c.get("fox")
    assert [v.field for v in not_an_id.value.field_violations] == ["task_id"]
    with pytest.raises(InvalidArgument) as bad:
        await c.submit("bad sizes", frames=8, width=33, height=32)
    assert {v.field for v in bad.value.field_violations} == {"params.num_frames", "params.width"}
    with pytest.raises(InvalidArgument) as empty:
        await c.submit("  ")
    assert [v.field for v in empty.value.field_violations] == ["prompt"]

    task = await dispatched(await c.submit("not yet", **SMALL))  # type: ignore[arg-type]
    with pytest.raises(FailedPrecondition) as early:
        await c.download(task.task_id, b.tmp / "early.mp4")
    assert early.value.reason == "TASK_NOT_SUCCEEDED" and not (b.tmp / "early.mp4").exists()
    with pytest.raises(InvalidArgument):
        [e async for e in c.watch(task.task_id, after_version=99)]
    canceled = await task.cancel()
    assert (canceled.status, canceled.version) == (Status.CANCELED, 3)
    assert (await canceled.cancel()).version == 3  # canceling again changes nothing
    with pytest.raises(TaskFailed) as ended:
        await canceled.download(b.tmp / "never.mp4")
    assert ended.value.task.status is Status.CANCELED

    done = await c.submit("finished", **SMALL)  # type: ignore[arg-type]
    await b.play(done.task_id, Succeed(b"video"))
    with pytest.raises(FailedPrecondition) as finished:
        await done.cancel()
    assert finished.value.reason == "TASK_FINISHED" and finished.value.metadata["status"] == "SUCCEEDED"


async def idempotency(b: Backend) -> None:
    """The same key and request give the same task; the same key with another request is refused."""
    c = b.client
    first = await c.submit("same request", idempotency_key="order-42", **SMALL)  # type: ignore[arg-type]
    again = await c.submit("same request", idempotency_key="order-42", **SMALL)  # type: ignore[arg-type]
    assert (again.task_id, again.created) == (first.task_id, False) and again.version >= first.version
    with pytest.raises(AlreadyExists) as reused:
        await c.submit("another request", idempotency_key="order-42", **SMALL)  # type: ignore[arg-type]
    assert reused.value.reason == "IDEMPOTENCY_KEY_REUSED" and reused.value.metadata["task_id"] == first.task_id
    other = await c.submit("same request", **SMALL)  # type: ignore[arg-type]
    assert other.task_id != first.task_id and other.created is True


async def failure(b: Backend) -> None:
    """A failed task: wait returns it, download and run raise TaskFailed with its final state."""
    c = b.client
    task = await c.submit("breaks", **SMALL)  # type: ignore[arg-type]
    waiting = asyncio.create_task(task.wait(10))
    await b.play(task.task_id, Fail("BOOM", "it broke"))
    done = await waiting
    assert (done.status, done.error_code, done.error_message, done.result) == (Status.FAILED, "BOOM", "it broke", None)
    with pytest.raises(TaskFailed) as failed:
        await task.download(b.tmp / "never.mp4")
    assert failed.value.task.error_code == "BOOM" and failed.value.task_id == task.task_id


async def run_in_one_call(b: Backend) -> None:
    """run() submits, follows and downloads."""
    c = b.client
    running = asyncio.create_task(c.run("run me", output=b.tmp / "run.mp4", timeout=10, **SMALL))  # type: ignore[arg-type]
    listed: list[Task] = []

    async def submitted() -> bool:
        listed[:] = [t async for t in c.list()]
        return bool(listed)

    await wait_for(submitted)
    await b.play(listed[0].task_id, Succeed(PAYLOAD))
    done = await running
    assert (done.task_id, done.status) == (listed[0].task_id, Status.SUCCEEDED)
    assert (b.tmp / "run.mp4").read_bytes() == PAYLOAD


def _png(width: int, height: int, **save: object) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), (width % 256, height % 256, 90)).save(out, format="PNG", **save)
    return out.getvalue()


async def image_to_video(b: Backend) -> None:
    """An image-to-video task from a file, its bytes or an upload (the SDK uploads a large file by itself): the image
    names the request, a bad image names its field."""
    c = b.client
    small = _png(48, 32)
    (b.tmp / "cat.png").write_bytes(small)
    first = await c.submit("the cat turns its head", I2V_MODEL, image=b.tmp / "cat.png", **SMALL)  # type: ignore[arg-type]
    assert first.task_type == "image-to-video" and first.image is not None and first.created
    again = await c.submit(
        "the cat turns its head", I2V_MODEL, image=small, idempotency_key=first.idempotency_key, **SMALL  # type: ignore[arg-type]
    )
    assert (again.task_id, again.created) == (first.task_id, False)
    assert (await c.upload_input(small)).sha256 == first.image.sha256
    big = _png(1000, 900, compress_level=0)  # over INLINE_IMAGE_BYTES: uploaded first, then named
    assert len(big) > INLINE_IMAGE_BYTES
    large = await c.submit("a wide shot", I2V_MODEL, image=big, **SMALL)  # type: ignore[arg-type]
    assert large.image is not None and large.image.sha256 == (await c.upload_input(big)).sha256
    with pytest.raises(InvalidArgument) as bad:
        await c.submit("not a picture", I2V_MODEL, image=b"GIF89a-or-anything-else", **SMALL)  # type: ignore[arg-type]
    assert [v.field for v in bad.value.field_violations] == ["image.data"]
    with pytest.raises(InvalidArgument) as missing:
        await c.submit("no picture", I2V_MODEL, task_type="image-to-video", **SMALL)  # type: ignore[arg-type]
    assert [v.field for v in missing.value.field_violations] == ["image"]
    with pytest.raises(InvalidArgument) as unknown:
        await c.submit("named", I2V_MODEL, image=b.tmp / "cat.png", task_type="text-to-video", **SMALL)  # type: ignore[arg-type]
    assert {v.field for v in unknown.value.field_violations} == {"task_type", "image"}


SCENARIOS = [lifecycle, errors, idempotency, failure, run_in_one_call, image_to_video]


@pytest.mark.parametrize("scenario", SCENARIOS)
async def test_scenario_against_the_fake(scenario: Callable[[Backend], Awaitable[None]], tmp_path: Path) -> None:
    # the test plays the worker, as for the real services
    async with FakeAsyncTaskgateClient(FakeTaskgate(outcome=StayQueued(), image_models=[I2V_MODEL])) as client:

        async def play(task_id: str, outcome: Succeed | Fail) -> None:
            client.server.finish(task_id, outcome)

        await scenario(Backend(client, play, tmp_path))


@pytest.mark.parametrize("scenario", SCENARIOS)
async def test_scenario_against_the_real_services(
    scenario: Callable[[Backend], Awaitable[None]], stack: Stack, tmp_path: Path
) -> None:
    async with stack.client() as client:

        async def play(task_id: str, outcome: Succeed | Fail) -> None:
            await play_real(stack.backends, task_id, outcome)

        await scenario(Backend(client, play, tmp_path))


# -- what only the fake does ---------------------------------------------------------------------------------------


async def test_tasks_run_when_followed_and_are_deterministic(tmp_path: Path) -> None:
    outputs = []
    for n in range(2):
        async with FakeAsyncTaskgateClient() as client:
            queued = await client.submit("a red fox")
            assert (await queued.refresh()).status is Status.QUEUED  # nobody follows it yet
            done = await client.run("a red fox", output=tmp_path / f"{n}.mp4")
            outputs.append((done.task_id, done.created_at, done.finished_at, done.params["seed"], done.result))
    assert outputs[0] == outputs[1]
    assert (tmp_path / "0.mp4").read_bytes() == (tmp_path / "1.mp4").read_bytes()


async def test_the_fake_makes_no_previews_and_finds_none(tmp_path: Path) -> None:
    async with FakeAsyncTaskgateClient() as client:
        done = await client.run("a red fox", output=tmp_path / "fox.mp4")
        assert [p async for p in client.previews(done.task_id)] == []
        assert [line async for line in client.logs(done.task_id)] == []
        with pytest.raises(NotFound):  # not the video in place of a preview
            await client.preview_bytes(done.task_id, "file:///previews/1-a1-s3.webp")


async def test_outcomes_by_function_and_timeout(tmp_path: Path) -> None:
    def script(task: Task) -> Fail | TimeOut | None:
        if "gore" in task.prompt:
            return Fail("NSFW", "refused")
        return TimeOut() if "slow" in task.prompt else None

    async with FakeAsyncTaskgateClient(outcome=script) as client:
        assert (await (await client.submit("a fox")).wait()).status is Status.SUCCEEDED
        assert (await (await client.submit("gore")).wait()).error_code == "NSFW"
        slow = await (await client.submit("slow")).wait()
        assert (slow.status, slow.error_code) == (Status.TIMEOUT, "PROCESSING_TIMEOUT")
        with pytest.raises(TaskFailed):
            await client.run("more gore", output=tmp_path / "x.mp4")
        assert [t.prompt for t in client.server.tasks()] == ["a fox", "gore", "slow", "more gore"]


async def test_injected_errors_and_limits() -> None:
    async with FakeAsyncTaskgateClient(FakeTaskgate(max_pending=1)) as client:
        client.server.fail_next("GetTask", grpc.StatusCode.UNAVAILABLE)
        client.server.fail_next(
            "SubmitTask", grpc.StatusCode.RESOURCE_EXHAUSTED, reason="RATE_LIMITED", retry_delay=2.0
        )
        with pytest.raises(ResourceExhausted) as limited:
            await client.submit("one")
        assert (limited.value.reason, limited.value.retry_delay) == ("RATE_LIMITED", 2.0)
        task = await client.submit("one")
        # UNAVAILABLE was retried
        assert (await client.get(task.task_id)).task_id == task.task_id and client.retries == 1
        with pytest.raises(ResourceExhausted) as pending:
            await client.submit("two")
        assert pending.value.reason == "TOO_MANY_PENDING_TASKS"  # as the real server says it
        with pytest.raises(TaskgateError) as admin:
            await client.stats()
        assert admin.value.code is grpc.StatusCode.UNIMPLEMENTED


async def test_watch_all_resumes_from_a_cursor() -> None:
    async with FakeAsyncTaskgateClient() as client:
        first = await client.submit("first")
        await first.wait()
        stream = client.watch_all(["SUCCEEDED"], cursor="0")
        assert (await anext(stream)).task_id == first.task_id
        saved = stream.cursor
        await stream.aclose()
        second = await client.submit("second")
        await second.wait()
        resumed = client.watch_all(["SUCCEEDED"], cursor=saved)
        assert [(e.task_id, e.status) for e in [await anext(resumed)]] == [(second.task_id, Status.SUCCEEDED)]
        await resumed.aclose()


def _blocking_fake(tmp_path: Path) -> tuple[list[str], str, str]:
    with FakeTaskgateClient(outcome=StayQueued()) as client:
        task = client.submit("held", **SMALL)  # type: ignore[arg-type]
        stream = client.watch_all(cursor="0")  # from the start: the stream opens at the first next()
        statuses = []
        client.server.finish(task.task_id, Succeed(b"bytes"))
        for event in stream:
            statuses.append(event.status.value)
            if event.terminal:
                break
        stream.close()
        done = task.wait(5)
        done.download(tmp_path / "held.mp4")
        return statuses, done.status.value, (tmp_path / "held.mp4").read_text()


async def test_blocking_fake(tmp_path: Path) -> None:
    statuses, status, data = await asyncio.to_thread(_blocking_fake, tmp_path)
    assert (
        statuses == ["CREATED", "QUEUED", "PROCESSING", "PROCESSING", "SUCCEEDED"]
        and status == "SUCCEEDED"
        and data == "bytes"
    )


async def test_the_fakes_budget_refuses_quota_exceeded_and_answers_a_retry() -> None:
    async with FakeAsyncTaskgateClient(FakeTaskgate(gpu_seconds_per_day=100.0, gpu_seconds_per_task=60.0)) as client:
        kept = await client.submit("one", idempotency_key="k")
        with pytest.raises(ResourceExhausted) as over:
            await client.submit("two")
        assert (
            over.value.reason == "QUOTA_EXCEEDED" and over.value.retry_delay is not None and over.value.retry_delay > 0
        )
        assert (await client.submit("one", idempotency_key="k")).task_id == kept.task_id  # the retry gets its task
        await client.cancel(kept.task_id)  # cancelled before it ran: its reservation is released
        assert (await client.submit("two")).prompt == "two"


async def test_the_fakes_token_budget_refuses_and_is_trued_up_to_the_tokens_used() -> None:
    fake = FakeTaskgate(tokens_per_day=60)
    async with FakeAsyncTaskgateClient(fake) as client:
        first = await client.chat("two words", "llama-tiny", max_output_tokens=40)  # reserves 2 + 40
        with pytest.raises(ResourceExhausted) as over:
            await client.chat("two words", "llama-tiny", max_output_tokens=40)
        assert over.value.reason == "QUOTA_EXCEEDED" and over.value.retry_delay is not None
        assert over.value.metadata == {
            "budget": "tokens",
            "window": "day",
            "tokens_left": "18",
            "tokens_estimate": "42",
        }
        done = await first.wait()  # its answer used far fewer than 40 tokens: the rest is free again
        assert done.status is Status.SUCCEEDED and done.input_tokens + done.output_tokens < 18
        assert (await client.chat("two words", "llama-tiny", max_output_tokens=40)).created


async def test_the_fake_takes_a_text_attachment_as_the_gateway_does() -> None:
    async with FakeAsyncTaskgateClient() as client:
        text = await client.upload_text("the whole document")
        assert (text.size_bytes, text.chars) == (18, 18)
        task = await client.chat(
            [{"role": "user", "content": "Summarise:", "content_sha256": text.sha256}], "llama-tiny", seed=3
        )
        inline = await client.chat("Summarise:\n\nthe whole document", "llama-tiny", seed=3)
        assert task.input_tokens == inline.input_tokens == 4 and task.prompt == inline.prompt  # counted as inline text
        with pytest.raises(InvalidArgument) as unknown:
            await client.chat([{"role": "user", "content": "x", "content_sha256": "0" * 64}], "llama-tiny")
        assert [v.field for v in unknown.value.field_violations] == ["chat.messages[0].content_sha256"]


async def test_the_fake_runs_chat_tasks(tmp_path: Path) -> None:
    async with FakeAsyncTaskgateClient() as client:
        task = await client.chat("review this diff", "llama-tiny", system="Be brief.", max_output_tokens=20, seed=3)
        assert task.task_type == "chat" and task.prompt == "review this diff" and task.input_tokens == 5
        assert task.params["max_output_tokens"] == 20 and task.params["seed"] == 3
        done = await task.wait()
        assert done.status is Status.SUCCEEDED and done.answer is not None and done.answer.finish_reason == "stop"
        assert done.output_tokens == len(done.answer.text.split())
        info = await done.download(tmp_path / "answer.txt")
        assert (tmp_path / "answer.txt").read_text() == done.answer.text and info.content_type.startswith("text/plain")
        again = await client.chat("review this diff", "llama-tiny", system="Be brief.", max_output_tokens=20, seed=3)
        assert (await again.wait()).answer == done.answer  # deterministic
        with pytest.raises(InvalidArgument) as refused:
            await client.chat([{"role": "robot", "content": "x"}], "llama-tiny")
        assert {v.field for v in refused.value.field_violations} == {"chat.messages[0].role", "chat.messages"}
        with pytest.raises(InvalidArgument) as video:
            await client.submit("a cat", "llama-tiny")
        assert {v.field for v in video.value.field_violations} == {"task_type"}


async def test_the_fake_streams_a_chat_answer_as_deltas() -> None:
    async with FakeAsyncTaskgateClient() as client:
        task = await client.chat("stream it", "llama-tiny")
        deltas = [d async for d in task.stream_text()]
        text = await task.text()
        assert len(deltas) > 1 and "".join(deltas) == text and all(d.attempt == 1 and not d.restarted for d in deltas)
        assert [d.offset for d in deltas] == [len("".join(deltas[:i])) for i in range(len(deltas))]
        assert [c.sequence for c in [c async for c in task.output()]] == sorted(
            {c.sequence for c in [c async for c in task.output()]}
        )
    with FakeTaskgateClient() as blocking:
        handle = blocking.chat("stream it", "llama-tiny")
        assert "".join(handle.stream_text()) == handle.text() == text
