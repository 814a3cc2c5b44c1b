"""Output webhooks (callback event OUTPUT) on the real tiny language model and the real notifier: an opted-in chat
task's receiver gets signed task.output webhooks whose chunks are the task's output stream, their text its final answer;
a task not opted in gets none; a failed one is covered by the next."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from services.notifier import service as notifier_service
from services.notifier.service import NotifierHandle
from taskgate import auth
from taskgate.config import ModelSpec, Settings
from taskgate.runtime import Backends
from taskgate.states import Status
from taskgate_api.v1 import gateway_pb2, task_pb2
from taskgate_client import verify_webhook
from tests.support.harness import WorkerFactory, wait_for
from tests.support.output import chunks
from tests.support.queries import is_status, wait_task
from tests.support.webhooks import Received, Reply, WebhookReceiver

MODEL = "llama-tiny"


@pytest.fixture
def settings(settings: Settings, tiny_lm: Path) -> Settings:
    spec = ModelSpec(kind="transformers", path=tiny_lm, max_sequences=4, max_input_tokens=4096, max_output_tokens=6000)
    return settings.model_copy(
        update={
            "models": {**settings.models, MODEL: spec},
            "worker_models": [MODEL],
            "webhook_output_window_seconds": 0.2,
        }
    )


@pytest.fixture
async def notifier(settings: Settings, backends: Backends) -> AsyncIterator[NotifierHandle]:
    handle = await notifier_service.start(settings, backends)
    try:
        yield handle
    finally:
        await handle.stop()


async def tenant(backends: Backends) -> tuple[Any, str]:
    key, secret = await auth.create_key(backends.pool, backends.settings.api_key_pepper, "tenant-hooks", max_pending=10)
    assert secret is not None
    return (("authorization", f"Bearer {key}"),), secret


async def submit(stub: Any, md: Any, url: str, events: list[str], seed: int) -> task_pb2.Task:
    params = task_pb2.ChatParams(
        messages=[task_pb2.ChatMessage(role="user", content=f"review this diff, part {seed}")],
        max_output_tokens=200,
        temperature=0.0,
        seed=seed,
    )
    request = gateway_pb2.SubmitTaskRequest(
        task_type="chat", model_id=MODEL, chat=params, callback_url=url, callback_events=events
    )
    task: task_pb2.Task = (await stub.SubmitTask(request, metadata=md, timeout=10)).task
    return task


def of(rx: WebhookReceiver, path: str, kind: str) -> list[Received]:
    return [r for r in rx.requests if r.path == path and r.json()["type"] == kind]


def delivered_text(bodies: list[dict[str, Any]], attempt: int) -> str:
    """The attempt's text from the delivered chunks, each starting where the one before it ended."""
    text = ""
    for chunk in sorted((c for b in bodies for c in b["data"]["chunks"]), key=lambda c: c["sequence"]):
        if chunk["attempt"] == attempt:
            assert chunk["kind"] == "text" and chunk["offset"] == len(text), (chunk["offset"], len(text))
            text += chunk["text"]
    return text


async def test_an_opted_in_chat_task_gets_its_output_as_signed_webhooks_and_another_gets_none(
    backends: Backends, stub: Any, workers: WorkerFactory, notifier: NotifierHandle, settings: Settings
) -> None:
    md, secret = await tenant(backends)
    await workers(settings)
    async with WebhookReceiver() as rx:
        opted = await submit(stub, md, rx.url("/in"), ["OUTPUT"], 1)
        plain = await submit(stub, md, rx.url("/out"), ["PROGRESS"], 2)
        done = await wait_task(backends, int(opted.id), is_status(Status.SUCCEEDED), within=60)
        await wait_task(backends, int(plain.id), is_status(Status.SUCCEEDED), within=60)
        await wait_for(lambda: bool(of(rx, "/in", "task.succeeded") and of(rx, "/out", "task.succeeded")), within=20)
        stored = await chunks(backends, opted.user_id, opted.id)
        last = stored[-1].sequence
        await wait_for(lambda: any(r.json()["data"]["last_sequence"] == last for r in of(rx, "/in", "task.output")))
        await wait_for(lambda: notifier.output_hooks is not None and notifier.output_hooks.followed == 0)

    assert done.result_text and len(stored) >= 1
    for request in rx.requests:  # every webhook signed, output ones too
        verify_webhook(request.headers, request.body, [secret])
    bodies = [r.json() for r in of(rx, "/in", "task.output")]
    assert all(b["data"]["task_id"] == opted.id for b in bodies)
    # each delivery a contiguous range of the stream, none twice (the receiver took every one)
    seen = [c["sequence"] for b in bodies for c in b["data"]["chunks"]]
    assert seen == [c.sequence for c in stored]
    for b in bodies:
        assert (b["data"]["first_sequence"], b["data"]["last_sequence"]) == (
            b["data"]["chunks"][0]["sequence"],
            b["data"]["chunks"][-1]["sequence"],
        )
    assert len({r.headers["webhook-id"] for r in of(rx, "/in", "task.output")}) == len(bodies)
    assert delivered_text(bodies, done.attempt) == done.result_text
    assert of(rx, "/out", "task.output") == []  # not opted in: none
    assert {r.json()["type"] for r in rx.requests if r.path == "/out"} == {"task.progress", "task.succeeded"}


async def test_a_failed_output_webhook_is_covered_by_the_next_one(
    backends: Backends, stub: Any, workers: WorkerFactory, notifier: NotifierHandle, settings: Settings
) -> None:
    md, secret = await tenant(backends)
    await workers(settings)

    def reply(request: Received) -> Reply:
        first_output = request.json()["type"] == "task.output" and not any(
            r.json()["type"] == "task.output" for r in rx.requests[: request.index]
        )
        return Reply(status=503) if first_output else Reply()

    async with WebhookReceiver(reply) as rx:
        task = await submit(stub, md, rx.url(), ["OUTPUT"], 3)
        done = await wait_task(backends, int(task.id), is_status(Status.SUCCEEDED), within=60)
        stored = await chunks(backends, task.user_id, task.id)
        last = stored[-1].sequence
        await wait_for(
            lambda: any(r.status == 200 and r.json()["data"].get("last_sequence") == last for r in rx.requests)
        )
        await wait_for(lambda: notifier.output_hooks is not None and notifier.output_hooks.followed == 0)
        # the terminal webhook is its own lane's: it may come after the last output one (a slow machine saw that)
        await wait_for(lambda: any(r.json()["type"] == "task.succeeded" and r.status == 200 for r in rx.requests))

    outputs = of(rx, "/hook", "task.output")
    failed, after = outputs[0], outputs[1]
    assert failed.status == 503 and after.status == 200
    for request in rx.requests:
        verify_webhook(request.headers, request.body, [secret])
    # the next delivery starts where the failed one did: nothing it carried is lost
    assert after.json()["data"]["first_sequence"] == failed.json()["data"]["first_sequence"]
    assert after.json()["data"]["last_sequence"] >= failed.json()["data"]["last_sequence"]
    delivered = [r.json() for r in outputs if r.status == 200]
    assert [c["sequence"] for b in delivered for c in b["data"]["chunks"]] == [c.sequence for c in stored]
    assert delivered_text(delivered, done.attempt) == done.result_text
    assert any(r.json()["type"] == "task.succeeded" and r.status == 200 for r in rx.requests)
