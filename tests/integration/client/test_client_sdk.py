"""The SDK's task handles, watch_all and docs/sdk.md's examples, against the real services."""

from __future__ import annotations

import ast
import asyncio
import inspect
import re
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from services.notifier import service as notifier_service
from services.submit import service as submit_service
from services.worker import service as worker_service
from taskgate import auth, store
from taskgate.config import ModelSpec, Settings
from taskgate.runtime import Backends
from taskgate_client import AsyncTaskgateClient, Status, SubmitOptions, TaskEvent, TaskgateClient, TaskHandle, connect
from taskgate_local.embedded import free_port
from tests.support.factories import claimed
from tests.support.harness import ROOT, wait_for
from tests.support.stacks import SMALL, Stack, run_task, run_task_finish

SDK_PAGE = ROOT / "docs" / "sdk.md"


def test_submit_options_are_the_submit_keywords() -> None:
    """run() and the blocking client take SubmitOptions: it must list exactly submit()'s keyword parameters."""
    params = inspect.signature(AsyncTaskgateClient.submit).parameters.values()
    assert {p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY} == set(SubmitOptions.__annotations__)
    for method in (TaskgateClient.submit, TaskgateClient.run, AsyncTaskgateClient.run):
        kwargs = [p for p in inspect.signature(method).parameters.values() if p.kind is inspect.Parameter.VAR_KEYWORD]
        assert [p.annotation for p in kwargs] == ["Unpack[SubmitOptions]"], method


async def test_watch_all_resumes_after_the_notifier_restarts(stack: Stack) -> None:
    async with stack.client() as client:
        stream = client.watch_all()
        seen: list[TaskEvent] = []

        async def consume() -> None:
            async for event in stream:
                seen.append(event)

        consumer = asyncio.create_task(consume())
        try:
            await wait_for(lambda: stream.cursor != "")  # the stream is live: "from now" starts here
            task = await client.submit("followed by watch_all", **SMALL)  # type: ignore[arg-type]
            await wait_for(lambda: len(seen) >= 2)
            await stack.notifier.kill()
            tid = int(task.task_id)
            await claimed(stack.backends.pool, tid, worker_id="w")
            await store.progress(stack.backends.pool, tid, attempt=1, percent=40, lease_seconds=30.0, actor="worker")
            stack.notifier = await notifier_service.start(stack.settings)
            await run_task_finish(stack.backends, task.task_id, attempt=1)
            await wait_for(lambda: bool(seen) and seen[-1].terminal, within=20)
            saved = stream.cursor
        finally:
            consumer.cancel()
            await asyncio.gather(consumer, return_exceptions=True)
            await stream.aclose()
        assert [(e.version, e.status, e.progress) for e in seen] == [
            (1, Status.CREATED, 0),
            (2, Status.QUEUED, 0),
            (3, Status.PROCESSING, 0),
            (4, Status.PROCESSING, 40),
            (5, Status.SUCCEEDED, 100),
        ]
        other = await client.submit("after the saved cursor", **SMALL)  # type: ignore[arg-type]
        resumed = client.watch_all(cursor=saved)
        got: list[tuple[str, int]] = []
        try:
            async for event in resumed:
                got.append((event.task_id, event.version))
                if event.task_id == other.task_id and event.status is Status.QUEUED:
                    break
        finally:
            await resumed.aclose()
        # A new stream may repeat a few events from just before its cursor (ids commit out of order), never skip one.
        assert [v for t, v in got if t == other.task_id] == [1, 2]
        assert {t for t, _ in got} <= {task.task_id, other.task_id}


def _blocking_session(running: Stack) -> tuple[str, ...]:
    with connect(running.address, running.api_key, events_address=running.events_address) as client:
        task = client.submit("from blocking code", **SMALL)  # type: ignore[arg-type]
        assert isinstance(task, TaskHandle) and isinstance(client.get(task.task_id), TaskHandle)
        # the dispatcher queues the task after the answer: the stream may open on the CREATED snapshot (v1), and then
        # streams the QUEUED move, which is awaited here
        first = next(e for e in task.events() if e.status is not Status.CREATED)
        canceled = task.cancel()
        stream = client.watch_all(cursor="0")
        event = next(stream)
        stream.close()
        return first.status.value, canceled.status.value, canceled.wait(5).status.value, event.task_id, stream.cursor


async def test_blocking_client_handles_and_watch_all(stack: Stack) -> None:
    first, canceled, waited, watched, cursor = await asyncio.to_thread(_blocking_session, stack)
    assert (first, canceled, waited) == ("QUEUED", "CANCELED", "CANCELED")
    assert watched and cursor


async def test_handle_download_waits_for_the_task(stack: Stack, tmp_path: Path) -> None:
    async with stack.client() as client:
        task = await client.submit("download when done", **SMALL)  # type: ignore[arg-type]
        downloading = asyncio.create_task(task.download(tmp_path / "out.mp4", timeout=10))
        await run_task(stack.backends, task.task_id, b"video")
        info = await downloading
    assert (tmp_path / "out.mp4").read_bytes() == b"video" and info.size_bytes == 5


# -- docs/sdk.md's examples run against a real stack ------------------------------------------------------------------


def readme_sdk_examples() -> list[str]:
    """The ```python blocks of docs/sdk.md's "Client SDK" section (its subsections included)."""
    text = SDK_PAGE.read_text() + "\n## "
    start = text.index("\n## Client SDK\n")
    end = text.index("\n## ", start + 1)
    return re.findall(r"```python\n(.*?)```", text[start:end], flags=re.DOTALL)


@pytest.fixture
async def worker_stack(settings: Settings, backends: Backends) -> AsyncIterator[dict[str, str]]:
    """Gateway, notifier and a worker whose default model sleeps briefly: what the examples' addresses become."""
    models = {**settings.models, "sdk-sleep": ModelSpec(kind="sleep", sleep_seconds=0.05)}
    settings = settings.model_copy(
        update={
            "models": models,
            "default_model": "sdk-sleep",
            "worker_models": ["sdk-sleep"],
            "callback_allow_hosts": ["me.example"],
            "notifier_port": free_port(),
        }
    )
    submit = await submit_service.start(settings, backends)
    notifier = await notifier_service.start(settings)
    worker = await worker_service.start(settings)
    api_key, _ = await auth.create_key(
        backends.pool, settings.api_key_pepper, "readme", max_pending=50, submits_per_minute=1000
    )
    try:
        yield {
            "gateway:50051": f"127.0.0.1:{submit.port}",
            "events:50052": f"127.0.0.1:{notifier.port}",
            "tg_…": api_key,
        }
    finally:
        await worker.stop(1.0)
        await notifier.stop()
        await submit.stop(0)


async def test_readme_sdk_examples_run(
    worker_stack: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    examples = readme_sdk_examples()
    assert len(examples) >= 3
    monkeypatch.chdir(tmp_path)  # the examples write fox.mp4
    monkeypatch.setenv("TASKGATE_EVENTS_ADDRESS", worker_stack["events:50052"])
    monkeypatch.setenv("TASKGATE_ADMIN_ADDRESS", f"127.0.0.1:{free_port()}")
    for n, source in enumerate(examples):
        for placeholder, real in worker_stack.items():
            source = source.replace(placeholder, real)
        code = compile(source, f"docs/sdk.md Client SDK example {n + 1}", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
        namespace: dict[str, object] = {"__name__": "readme"}
        if code.co_flags & inspect.CO_COROUTINE:
            await asyncio.wait_for(eval(code, namespace), 60)  # top-level await: runs on this loop, beside the stack
        else:
            await asyncio.wait_for(asyncio.to_thread(exec, code, namespace), 60)  # blocking: off the stack's loop
    assert (tmp_path / "fox.mp4").stat().st_size > 0
