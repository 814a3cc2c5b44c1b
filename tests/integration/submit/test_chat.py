"""Chat tasks at the gateway (#34): the request's shape over gRPC and HTTP, its input counted with the model's own
tokenizer at admission, each task type's parameters refused on the other, idempotency over the chat parameters."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from taskgate.config import ModelSpec, Settings
from taskgate.runtime import Backends
from taskgate_api.v1 import gateway_pb2, task_pb2
from tests.support import harness
from tests.support.factories import key_for
from tests.support.harness import HttpStack, outcome, violations

SMALL_INPUT = 200  # max_input_tokens of the "llama-tiny" entry here


@pytest.fixture
def settings(settings: Settings, tiny_lm: Path) -> Settings:
    models = {
        **settings.models,
        "llama-tiny": ModelSpec(kind="transformers", path=tiny_lm, max_input_tokens=SMALL_INPUT, max_output_tokens=512),
        "llama-long": ModelSpec(kind="transformers", path=tiny_lm, max_input_tokens=10_000_000),
    }
    return settings.model_copy(update={"models": models})


def chat_request(**fields: Any) -> gateway_pb2.SubmitTaskRequest:
    fields.setdefault("model_id", "llama-tiny")
    return gateway_pb2.SubmitTaskRequest(task_type="chat", **fields)


def conversation(*turns: tuple[str, str]) -> task_pb2.ChatParams:
    return task_pb2.ChatParams(messages=[task_pb2.ChatMessage(role=r, content=c) for r, c in turns])


def transformers_count(folder: Path, messages: list[dict[str, str]]) -> int:
    """The worker's count: transformers' own apply_chat_template."""
    from transformers import AutoTokenizer

    tokenizer: Any = AutoTokenizer.from_pretrained(str(folder))
    encoded: Any = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    return len(encoded["input_ids"])


async def test_a_chat_task_is_admitted_with_its_parameters_and_counted_input(
    stub: Any, backends: Backends, tiny_lm: Path
) -> None:
    md = await key_for(backends, max_pending=10)
    params = conversation(("system", "You review code."), ("user", "the diff: return value"), ("assistant", "ok"),
                          ("user", "and the error test?"))
    params.max_output_tokens = 40
    params.temperature = 0.7
    params.stop.append("\n\n")
    made = await stub.SubmitTask(chat_request(chat=params), metadata=md, timeout=10)
    task = made.task
    assert made.created and task.task_type == "chat" and task.status == task_pb2.TASK_STATUS_CREATED
    assert (
        task.chat.max_output_tokens == 40
        and round(task.chat.temperature, 4) == 0.7
        and list(task.chat.stop) == ["\n\n"]
    )
    assert task.chat.top_p == 1.0 and task.chat.HasField("seed")  # the model's default; a seed chosen and stored
    assert not task.chat.messages and task.prompt == "and the error test?"  # not echoed: the last user turn shows
    assert not task.HasField("params") and not task.HasField("text")
    messages = [{"role": m.role, "content": m.content} for m in params.messages]
    assert task.usage.input_tokens == transformers_count(tiny_lm, messages) > 0
    row = await backends.pool.fetchrow("SELECT request_payload, prompt FROM task WHERE id = $1", int(task.id))
    assert row["request_payload"]["messages"] == messages and row["prompt"] == "and the error test?"

    plain = await stub.SubmitTask(
        chat_request(prompt="hello there", chat=task_pb2.ChatParams(seed=3)), metadata=md, timeout=10
    )
    assert plain.created and plain.task.chat.seed == 3 and plain.task.chat.max_output_tokens == 256  # the default
    assert plain.task.usage.input_tokens == transformers_count(tiny_lm, [{"role": "user", "content": "hello there"}])
    got = await stub.GetTask(gateway_pb2.GetTaskRequest(task_id=plain.task.id), metadata=md, timeout=5)
    assert got.task.chat == plain.task.chat and got.task.usage.input_tokens == plain.task.usage.input_tokens


@pytest.mark.parametrize(
    ("request_fields", "fields"),
    [
        ({"task_type": "text-to-video", "model_id": "wan-tiny", "prompt": "a cat", "chat": task_pb2.ChatParams(seed=1)},
         {"chat"}),
        ({"prompt": "hi", "params": task_pb2.VideoParams(num_frames=9, fps=8)}, {"params.num_frames", "params.fps"}),
        ({"model_id": "wan-tiny", "prompt": "hi"}, {"task_type"}),
        ({"prompt": "", "chat": task_pb2.ChatParams()}, {"prompt"}),
        ({"prompt": "both", "chat": conversation(("user", "x"))}, {"prompt"}),
        ({"chat": conversation(("robot", "x"), ("user", "y"))}, {"chat.messages[0].role"}),
        ({"chat": conversation(("user", "x"), ("assistant", "y"))}, {"chat.messages[1].role"}),
        ({"chat": conversation(("user", "nul \x00"))}, {"chat.messages[0].content"}),
        ({"prompt": "hi", "chat": task_pb2.ChatParams(max_output_tokens=513)}, {"chat.max_output_tokens"}),
        ({"prompt": "hi", "chat": task_pb2.ChatParams(max_output_tokens=0)}, {"chat.max_output_tokens"}),
        ({"prompt": "hi", "chat": task_pb2.ChatParams(temperature=2.5)}, {"chat.temperature"}),
        ({"prompt": "hi", "chat": task_pb2.ChatParams(top_p=0.0)}, {"chat.top_p"}),
        ({"prompt": "hi", "chat": task_pb2.ChatParams(stop=["a", "b", "c", "d", "e"])}, {"chat.stop"}),
        ({"prompt": "hi", "chat": task_pb2.ChatParams(stop=[""])}, {"chat.stop"}),
        ({"prompt": "hi", "chat": task_pb2.ChatParams(seed=-1)}, {"chat.seed"}),
        ({"prompt": "word " * 400}, {"prompt"}),  # over the model's max_input_tokens
        ({"chat": conversation(("system", "word " * 400), ("user", "hi"))}, {"chat.messages"}),
    ],
)
async def test_each_bad_chat_field_is_named(
    stub: Any, backends: Backends, request_fields: dict[str, Any], fields: set[str]
) -> None:
    md = await key_for(backends, max_pending=10)
    request = (
        chat_request(**request_fields)
        if "task_type" not in request_fields
        else gateway_pb2.SubmitTaskRequest(**request_fields)
    )
    code, details, _ = await outcome(stub.SubmitTask(request, metadata=md, timeout=10))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert violations(details) == fields


async def test_a_megabyte_of_input_is_accepted_and_counted(stub: Any, backends: Backends) -> None:
    md = await key_for(backends, max_pending=10)
    document = ("def review(diff):\n\treturn value  # the error test\r\n" * 30_000)[: 1024 * 1024 + 7]
    made = await stub.SubmitTask(
        chat_request(model_id="llama-long", chat=conversation(("system", "Summarise."), ("user", document))),
        metadata=md, timeout=30,
    )
    assert made.created and made.task.usage.input_tokens > 100_000
    assert len(made.task.prompt) == 2000  # the last user turn's beginning (max_prompt_chars)
    assert len(made.task.SerializeToString()) < 10_000  # the input is not echoed


async def test_the_request_hash_covers_the_chat_parameters(stub: Any, backends: Backends) -> None:
    md = await key_for(backends, max_pending=10)

    async def ask(**chat: Any) -> Any:
        params = conversation(("user", "the same question"))
        for name, value in chat.items():
            setattr(params, name, value)
        return await stub.SubmitTask(chat_request(chat=params, idempotency_key=""), metadata=md, timeout=10)

    first, again = await ask(seed=5, temperature=0.0), await ask(seed=5, temperature=0.0)
    assert first.created and not again.created and again.task.id == first.task.id
    warmer, longer, reseeded = (
        await ask(seed=5, temperature=0.5),
        await ask(seed=5, temperature=0.0, max_output_tokens=9),
        await ask(seed=6, temperature=0.0),
    )
    assert warmer.created and longer.created and reseeded.created
    assert len({first.task.id, warmer.task.id, longer.task.id, reseeded.task.id}) == 4


@pytest.fixture
async def http(settings: Settings, backends: Backends) -> AsyncIterator[tuple[HttpStack, httpx.AsyncClient]]:
    async with harness.http_stack(settings, backends) as stack, httpx.AsyncClient(
        base_url=stack.url, headers=stack.headers(), timeout=20
    ) as client:
        yield stack, client


async def test_chat_over_http(http: tuple[HttpStack, httpx.AsyncClient], tiny_lm: Path) -> None:
    _, client = http
    body = {"task_type": "chat", "model_id": "llama-tiny",
            "chat": {"messages": [{"role": "user", "content": "hello"}], "max_output_tokens": 12, "seed": "4"}}
    made = await client.post("/v1/tasks", json=body)
    assert made.status_code == 201, made.text
    task = made.json()["task"]
    assert task["task_type"] == "chat" and task["chat"]["max_output_tokens"] == 12 and task["chat"]["seed"] == "4"
    assert int(task["usage"]["input_tokens"]) == transformers_count(tiny_lm, [{"role": "user", "content": "hello"}])
    got = await client.get(f"/v1/tasks/{task['id']}")
    assert got.status_code == 200 and got.json()["task"]["chat"] == task["chat"]
    refused = await client.post("/v1/tasks", json={**body, "params": {"num_frames": 9}})
    assert refused.status_code == 400
    fields = {v["field"] for d in refused.json()["error"]["details"] for v in d.get("field_violations", [])}
    assert fields == {"params.num_frames"}


async def test_the_sdk_submits_a_chat(gateway: Any, backends: Backends, tiny_lm: Path) -> None:
    from taskgate_client import connect_async

    md = await key_for(backends, max_pending=10)
    async with connect_async(f"127.0.0.1:{gateway.port}", md[0][1].removeprefix("Bearer ")) as client:
        task = await client.chat(
            "hello", "llama-tiny", system="Be brief.", max_output_tokens=10, temperature=0.0, seed=1
        )
        assert task.created and task.task_type == "chat" and task.prompt == "hello" and task.answer is None
        assert task.params == {"max_output_tokens": 10, "temperature": 0.0, "top_p": 1.0, "stop": [], "seed": 1}
        turns = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}]
        assert task.input_tokens == transformers_count(tiny_lm, turns)
        again = await client.chat(turns, "llama-tiny", max_output_tokens=10, temperature=0.0, seed=1,
                                  idempotency_key=task.idempotency_key)
        assert again.created is False and again.task_id == task.task_id  # the same conversation, as a list
