"""Chat tasks on an upstream model (kind "openai-compatible") through the gateway, against a real OpenAI-compatible
server (llama.cpp's, serving the tiny chat model): SUCCEEDED with the answer inline, its tokens and its deltas on the
output stream; the entry's upstream_extra_body reaching the server; an upstream that is down is a retryable failure.
(A cancel closing the upstream's stream is tested on the backend itself, tests/integration/worker/test_upstream.py.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from services.worker.settle import Fate
from taskgate.config import ModelSpec, Settings
from taskgate.runtime import Backends
from taskgate.states import Status
from taskgate_api.v1 import gateway_pb2, task_pb2
from taskgate_local.embedded import free_port
from tests.support.factories import key_for
from tests.support.harness import WorkerFactory
from tests.support.llamaserver import LlamaServer
from tests.support.output import chunks, text_of
from tests.support.queries import is_status, report_for, wait_task

MODEL = "tiny-upstream"
KEY_VARIABLE = "TASKGATE_TEST_UPSTREAM_KEY"


def upstream_spec(base_url: str, tokenizer: Path, **changes: Any) -> ModelSpec:
    fields: dict[str, Any] = {
        "kind": "openai-compatible",
        "base_url": base_url,
        "upstream_model": "tiny-chat-upstream",
        "api_key_env": KEY_VARIABLE,
        "tokenizer": tokenizer,
        "max_output_tokens": 2000,
        "upstream_max_requests": 2,
    }
    return ModelSpec(**(fields | changes))


@pytest.fixture
def settings(settings: Settings, llama_server: LlamaServer, tiny_lm: Path, monkeypatch: pytest.MonkeyPatch) -> Settings:
    """The gateway's and the worker's registry with the upstream model, its key in the worker's environment."""
    monkeypatch.setenv(KEY_VARIABLE, llama_server.api_key or "")
    spec = upstream_spec(llama_server.base_url, tiny_lm)
    return settings.model_copy(update={"models": {**settings.models, MODEL: spec}, "worker_models": [MODEL]})


async def submit(stub: Any, md: Any, content: str, **chat: Any) -> task_pb2.Task:
    params = task_pb2.ChatParams(messages=[task_pb2.ChatMessage(role="user", content=content)], **chat)
    made = await stub.SubmitTask(
        gateway_pb2.SubmitTaskRequest(task_type="chat", model_id=MODEL, chat=params), metadata=md, timeout=10
    )
    task: task_pb2.Task = made.task
    return task


async def test_a_chat_task_through_the_gateway_streams_from_the_upstream_and_succeeds(
    settings: Settings, backends: Backends, stub: Any, workers: WorkerFactory
) -> None:
    md = await key_for(backends, max_pending=10)
    # llama.cpp's own min_tokens, sent as the entry's upstream_extra_body: the answer runs to max_output_tokens
    spec = settings.models[MODEL].model_copy(update={"upstream_extra_body": {"min_tokens": 40}})
    await workers(settings.model_copy(update={"models": {**settings.models, MODEL: spec}}))
    task = await submit(stub, md, "Review this diff: return value", max_output_tokens=40, temperature=0.0, seed=1)
    assert task.usage.input_tokens > 0  # counted at admission with the model's tokenizer (the upstream's own model)
    await wait_task(backends, int(task.id), is_status(Status.SUCCEEDED), within=60)
    got = (await stub.GetTask(gateway_pb2.GetTaskRequest(task_id=task.id), metadata=md, timeout=5)).task
    answer = got.text
    assert answer.finish_reason == "length" and answer.text and answer.chars == len(answer.text)
    assert got.usage.input_tokens == task.usage.input_tokens and 0 < got.usage.output_tokens <= 40
    assert got.usage.gpu_seconds == 0  # none of this worker's devices: the upstream's
    found = await chunks(backends, got.user_id, task.id)
    assert found and text_of(found, 1) == answer.text  # relayed in order, no gap, nothing twice


async def test_an_upstream_that_is_down_fails_the_attempt_retryably(
    settings: Settings, backends: Backends, stub: Any, workers: WorkerFactory, tiny_lm: Path
) -> None:
    md = await key_for(backends, max_pending=10)
    down = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    spec = upstream_spec(down, tiny_lm, api_key_env=None, upstream_connect_timeout_seconds=2)
    handle = await workers(
        settings.model_copy(update={"models": {**settings.models, MODEL: spec}, "worker_models": [MODEL]})
    )
    task = await submit(stub, md, "anyone there?", max_output_tokens=5)
    report = await handle.worker.signals.reported.wait_for(report_for(int(task.id)), within=60)
    assert (report.outcome, report.error_code) == (Fate.RETRIED, "UPSTREAM_UNAVAILABLE")
    row = await wait_task(backends, int(task.id), lambda r: r.retry_count == 1)
    assert row.error_code == "UPSTREAM_UNAVAILABLE"
