"""Chat tasks on the worker (#34) with the real tiny language model: the answer inline and whole, its deltas on the
output stream in order, several tasks decoding at once on one loaded model (a hard-cancelled one leaves, the others
finish with the text they make alone), and a worker killed mid-generation."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from services.notifier import outbox
from services.worker.chatrun import ChatRunner
from taskgate.config import ModelSpec, Settings
from taskgate.runtime import Backends
from taskgate.states import Status
from taskgate.store import events as event_store
from taskgate.store import usage
from taskgate_api.v1 import gateway_pb2, task_pb2
from tests.support.factories import key_for
from tests.support.harness import WorkerFactory, wait_for
from tests.support.output import chunks, text_of
from tests.support.queries import events, is_status, report_for, wait_task

MODEL = "llama-tiny"


@pytest.fixture
def settings(settings: Settings, tiny_lm: Path) -> Settings:
    spec = ModelSpec(kind="transformers", path=tiny_lm, max_sequences=4, max_input_tokens=4096, max_output_tokens=6000)
    return settings.model_copy(update={"models": {**settings.models, MODEL: spec}, "worker_models": [MODEL]})


async def submit(stub: Any, md: Any, content: str, **chat: Any) -> task_pb2.Task:
    params = task_pb2.ChatParams(messages=[task_pb2.ChatMessage(role="user", content=content)], **chat)
    made = await stub.SubmitTask(
        gateway_pb2.SubmitTaskRequest(task_type="chat", model_id=MODEL, chat=params), metadata=md, timeout=10
    )
    task: task_pb2.Task = made.task
    return task


async def whole_result(stub: Any, md: Any, task_id: str) -> tuple[bytes, str]:
    data, content_type = b"", ""
    async for part in stub.GetTaskResult(gateway_pb2.GetTaskResultRequest(task_id=task_id), metadata=md, timeout=10):
        if part.HasField("info"):
            content_type = part.info.content_type
        data += part.data
    return data, content_type


def chat_runner(handle: Any) -> ChatRunner:
    [runner] = [r for r in handle.worker.attempts.runners.values() if isinstance(r, ChatRunner)]
    return runner


async def test_a_chat_task_succeeds_with_its_answer_inline_whole_and_streamed(
    settings: Settings, backends: Backends, stub: Any, workers: WorkerFactory, tiny_lm: Path
) -> None:
    md = await key_for(backends, max_pending=10)
    handle = await workers(settings)
    task = await submit(stub, md, "Review this diff: return value", max_output_tokens=80, temperature=0.0)
    await wait_task(backends, int(task.id), is_status(Status.SUCCEEDED), within=60)
    got = (await stub.GetTask(gateway_pb2.GetTaskRequest(task_id=task.id), metadata=md, timeout=5)).task
    answer = got.text
    assert answer.finish_reason in ("stop", "length") and answer.text and not answer.truncated
    assert answer.chars == len(answer.text)
    assert got.usage.input_tokens == task.usage.input_tokens > 0 and 0 < got.usage.output_tokens <= 80
    data, content_type = await whole_result(stub, md, task.id)
    assert data.decode() == answer.text and content_type.startswith("text/plain")
    listed = (await stub.ListTasks(gateway_pb2.ListTasksRequest(), metadata=md, timeout=5)).tasks
    # GetTask has it
    assert [(t.text.text, t.text.truncated, t.text.chars) for t in listed] == [("", True, answer.chars)]
    found = await chunks(backends, got.user_id, task.id)
    assert found and text_of(found, 1) == answer.text  # in order, no gap, nothing twice
    # the same tokens as transformers' own greedy generate, decoded the same way
    runner = chat_runner(handle)
    ids = runner.prompt_ids([{"role": "user", "content": "Review this diff: return value"}])
    import torch

    generated = runner.model.generate(torch.tensor([ids]), max_new_tokens=80, do_sample=False)[0][len(ids):].tolist()
    eos = set(runner.batcher.eos_ids)
    tokens = [t for t in generated[: next((i for i, t in enumerate(generated) if t in eos), len(generated))]]
    assert len(tokens) == got.usage.output_tokens
    assert runner.tokenizer.decode(tokens, skip_special_tokens=True) == answer.text  # byte pieces (invalid UTF-8) too

    # regenerate: the same conversation and parameters, a new seed
    again = (
        await stub.RegenerateTask(gateway_pb2.RegenerateTaskRequest(task_id=task.id, seed=99), metadata=md, timeout=10)
    ).task
    assert again.task_type == "chat" and again.id != task.id and again.chat.seed == 99
    assert (again.chat.max_output_tokens, again.chat.temperature) == (80, 0.0)
    assert again.usage.input_tokens == task.usage.input_tokens and again.prompt == task.prompt
    await wait_task(backends, int(again.id), is_status(Status.SUCCEEDED), within=60)

    # metered in tokens: per tenant, model and hour, and on the finished task's webhook
    [metered] = await usage.usage(
        backends.pool,
        since=datetime.now(UTC) - timedelta(hours=1),
        until=datetime.now(UTC) + timedelta(minutes=1),
        tenant_id=got.user_id,
        limit=10,
    )
    regenerated = await wait_task(backends, int(again.id), is_status(Status.SUCCEEDED))
    assert (metered.model_id, metered.input_tokens, metered.output_tokens) == (
        MODEL, got.usage.input_tokens + regenerated.input_tokens, got.usage.output_tokens + regenerated.output_tokens)
    async with backends.pool.acquire() as conn, conn.transaction():
        relayed = [r for r in await event_store.take_unpublished(conn, limit=100) if r.event.task_id == int(task.id)]
    body = outbox.payload(relayed[-1], "task.succeeded")
    assert body["data"]["usage"]["input_tokens"] == got.usage.input_tokens
    assert body["data"]["usage"]["output_tokens"] == got.usage.output_tokens


async def test_tasks_share_one_model_and_a_hard_cancelled_one_leaves_the_others_untouched(
    settings: Settings, backends: Backends, stub: Any, workers: WorkerFactory
) -> None:
    md = await key_for(backends, max_pending=20)
    handle = await workers(settings)
    runner = chat_runner(handle)
    sampled = [
        {
            "content": f"question {i}: what is the error?",
            "max_output_tokens": 300,
            "temperature": 0.9,
            "top_p": 0.9,
            "seed": 10 + i,
        }
        for i in range(3)
    ]

    async def ask(item: dict[str, Any]) -> task_pb2.Task:
        return await submit(stub, md, **item)

    alone = []
    for item in sampled:  # each on its own first: the text it makes alone
        task = await ask(item)
        alone.append(await wait_task(backends, int(task.id), is_status(Status.SUCCEEDED), within=60))
    assert all(r.result_text for r in alone)

    long = await submit(stub, md, "write the whole code review", max_output_tokens=6000, temperature=0.0)
    await wait_for(lambda: runner.batcher.active == 1, within=30)
    fresh = []  # the same requests again, under keys of their own: new tasks
    for i, item in enumerate(sampled):
        params = task_pb2.ChatParams(messages=[task_pb2.ChatMessage(role="user", content=str(item["content"]))],
                                     max_output_tokens=300, temperature=0.9, top_p=0.9, seed=10 + i)
        made = await stub.SubmitTask(
            gateway_pb2.SubmitTaskRequest(task_type="chat", model_id=MODEL, chat=params, idempotency_key=f"again-{i}"),
            metadata=md,
            timeout=10,
        )
        fresh.append(made.task)
    await wait_for(lambda: runner.batcher.active == 4, within=30)  # four sequences decoding on one loaded model
    steps_at_cancel = runner.batcher.steps
    cancelled = await stub.CancelTask(
        gateway_pb2.CancelTaskRequest(task_id=long.id, hard=True), metadata=md, timeout=10
    )
    assert cancelled.task.status == task_pb2.TASK_STATUS_CANCELED
    await wait_for(lambda: runner.batcher.active <= 3, within=10)
    left_after = runner.batcher.steps - steps_at_cancel
    finished = [await wait_task(backends, int(t.id), is_status(Status.SUCCEEDED), within=60) for t in fresh]
    assert [r.result_text for r in finished] == [r.result_text for r in alone]  # untouched by their neighbours
    assert [r.output_tokens for r in finished] == [r.output_tokens for r in alone]
    row = await wait_task(backends, int(long.id), is_status(Status.CANCELED))
    assert row.result_uri is None
    # the cancel reached the loop over a NATS signal and a row read; the sequence left at the next step boundary
    assert left_after < 100, left_after
    streamed = text_of(await chunks(backends, long.user_id, long.id), 1)
    await asyncio.sleep(0.3)  # nothing more is published for the cancelled task
    assert text_of(await chunks(backends, long.user_id, long.id), 1) == streamed


async def test_a_worker_killed_mid_generation_leaves_the_task_retried_and_finished_once(
    settings: Settings, backends: Backends, stub: Any, workers: WorkerFactory
) -> None:
    quick = settings.model_copy(update={"lease_seconds": 2.0, "heartbeat_seconds": 0.5})
    md = await key_for(backends, max_pending=10)
    first = await workers(quick)
    task = await submit(stub, md, "a long answer, please", max_output_tokens=3000, temperature=0.0)

    async def streaming() -> bool:
        return bool(await chunks(backends, task.user_id, task.id))

    await wait_for(streaming, within=30)
    await first.kill()
    second = await workers(quick)
    row = await wait_task(backends, int(task.id), is_status(Status.SUCCEEDED), within=90)
    assert (row.attempt, row.worker_id) == (2, second.worker_id)
    history = await events(backends, int(task.id))
    assert [e["to_status"] for e in history].count("SUCCEEDED") == 1
    found = await chunks(backends, task.user_id, task.id)
    assert {c.attempt for c in found} == {1, 2}
    first_text = text_of(found, 1)
    # the second attempt went on from the text the lost one had published (text resume, test_text_resume.py)
    assert first_text + text_of(found, 2, start=len(first_text)) == row.result_text


async def test_a_chat_task_over_http_ends_with_its_answer(settings: Settings, backends: Backends) -> None:
    import httpx

    from tests.support import harness

    async with harness.http_stack(settings, backends, worker_models=[MODEL]) as stack, httpx.AsyncClient(
        base_url=stack.url, headers=stack.headers(), timeout=20
    ) as client:
        body = {
            "task_type": "chat",
            "model_id": MODEL,
            "prompt": "hello",
            "chat": {"max_output_tokens": 30, "temperature": 0},
        }
        made = await client.post("/v1/tasks", json=body)
        assert made.status_code == 201, made.text
        task_id = made.json()["task"]["id"]
        seen: dict[str, Any] = {}

        async def done() -> bool:
            seen.update((await client.get(f"/v1/tasks/{task_id}")).json()["task"])
            return bool(seen["status"] == "TASK_STATUS_SUCCEEDED")

        await wait_for(done, within=60)
        assert seen["text"]["text"] and seen["text"]["finish_reason"] in ("stop", "length")
        assert int(seen["usage"]["input_tokens"]) > 0 and int(seen["usage"]["output_tokens"]) > 0
        result = await client.get(f"/v1/tasks/{task_id}/result")
        assert result.status_code == 200 and result.headers["content-type"].startswith("text/plain")
        assert result.text == seen["text"]["text"]


async def test_a_soft_cancelled_chat_answer_is_reused_by_the_same_request(
    settings: Settings, backends: Backends, stub: Any, workers: WorkerFactory
) -> None:
    md = await key_for(backends, max_pending=10)
    handle = await workers(settings)
    params = task_pb2.ChatParams(messages=[task_pb2.ChatMessage(role="user", content="the same long answer")],
                                 max_output_tokens=1500, temperature=0.0, seed=1)

    async def ask(key: str) -> task_pb2.Task:
        request = gateway_pb2.SubmitTaskRequest(task_type="chat", model_id=MODEL, chat=params, idempotency_key=key)
        made: task_pb2.Task = (await stub.SubmitTask(request, metadata=md, timeout=10)).task
        return made

    first = await ask("first")
    await wait_task(backends, int(first.id), is_status(Status.PROCESSING))
    await stub.CancelTask(gateway_pb2.CancelTaskRequest(task_id=first.id, hard=False), metadata=md, timeout=10)
    kept = await handle.worker.signals.reported.wait_for(report_for(int(first.id)), within=60)
    assert kept.outcome == "soft_canceled"  # it ran to its end, and its answer was kept
    second = await ask("second")  # another key, the same request: the kept answer is its result
    row = await wait_task(backends, int(second.id), is_status(Status.SUCCEEDED), within=30)
    assert row.result_reused and row.result_text and row.finish_reason == "stop"
    got = (await stub.GetTask(gateway_pb2.GetTaskRequest(task_id=second.id), metadata=md, timeout=5)).task
    assert got.text.text == row.result_text and got.usage.output_tokens == 0  # nothing generated for it
    data, _ = await whole_result(stub, md, second.id)
    assert data.decode() == row.result_text


async def test_the_first_delta_goes_out_at_once_and_later_ones_are_coalesced(
    settings: Settings, backends: Backends, stub: Any, workers: WorkerFactory
) -> None:
    """The time to first token is not held by the coalescing window; what follows is gathered for it."""
    coalesce = 10.0
    md = await key_for(backends, max_pending=10)
    await workers(settings.model_copy(update={"output_coalesce_seconds": coalesce}))
    task = await submit(stub, md, "Write a long story about a fox.", max_output_tokens=60, temperature=0.9, seed=3)
    await wait_for(lambda: _has_output(backends, task), 60)
    [first, *_] = await chunks(backends, task.user_id, task.id)
    started = await wait_task(backends, int(task.id), lambda row: row.started_at is not None, within=10)
    assert started.started_at is not None
    # before the window could have ended once: the first delta did not wait for it
    assert first.at.ToDatetime(tzinfo=UTC) < started.started_at + timedelta(seconds=coalesce / 2)
    done = await wait_task(backends, int(task.id), is_status(Status.SUCCEEDED), within=60)
    assert done.status == Status.SUCCEEDED
    found = await chunks(backends, task.user_id, task.id)
    assert found[0].sequence == first.sequence and len(found[0].text) > 0
    assert len(found) == 2  # the rest, made within one window, went as one chunk
    got = (await stub.GetTask(gateway_pb2.GetTaskRequest(task_id=task.id), metadata=md, timeout=5)).task
    assert text_of(found, 1) == got.text.text


async def _has_output(backends: Backends, task: task_pb2.Task) -> bool:
    return bool(await chunks(backends, task.user_id, task.id))
