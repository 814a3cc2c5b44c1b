"""The OpenAI face (#36) driven by the official `openai` client against the running stack: background responses
(create, retrieve, cancel, a stream resumed with starting_after after a dropped connection), files and a 100-line
batch to its output and error files, errors in OpenAI's shape with the statuses the client maps to its exceptions."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from taskgate.config import ModelSpec, Settings
from taskgate.runtime import Backends
from tests.support import harness
from tests.support.harness import HttpStack, wait_for

TERMINAL = {"completed", "failed", "cancelled", "incomplete"}


@pytest.fixture
def settings(settings: Settings, tiny_lm: Path) -> Settings:
    models = {
        **settings.models,
        "llama-tiny": ModelSpec(kind="transformers", path=tiny_lm, max_output_tokens=512),
        "llama-held": ModelSpec(kind="transformers", path=tiny_lm),  # nobody serves it: its tasks wait QUEUED
    }
    return settings.model_copy(update={
        "models": models, "submits_per_minute": 100_000, "stream_keepalive_seconds": 0.5, "batch_chunk_lines": 40,
    })


@pytest.fixture
async def stack(settings: Settings, backends: Backends) -> AsyncIterator[HttpStack]:
    async with harness.http_stack(settings, backends, worker_models=["llama-tiny"]) as s:
        yield s


@pytest.fixture
async def client(stack: HttpStack) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(
        base_url=f"{stack.url}/openai/v1", api_key=stack.api_key, max_retries=0, timeout=30
    ) as c:
        yield c


async def finished(client: openai.AsyncOpenAI, response_id: str) -> Any:
    async def done() -> bool:
        return (await client.responses.retrieve(response_id)).status in TERMINAL

    await wait_for(done, within=120)
    return await client.responses.retrieve(response_id)


async def test_errors_have_openai_shapes_and_statuses(client: openai.AsyncOpenAI, stack: HttpStack) -> None:
    names = {m.id async for m in client.models.list()}
    assert {"llama-tiny", "llama-held"} <= names
    with pytest.raises(openai.NotFoundError) as missing:
        await client.responses.create(model="gpt-nothing", input="hi", background=True)
    assert missing.value.code == "model_not_found" and missing.value.param == "model"
    with pytest.raises(openai.BadRequestError) as foreground:
        await client.responses.create(model="llama-tiny", input="hi")
    assert foreground.value.param == "background" and foreground.value.code == "background_required"
    with pytest.raises(openai.BadRequestError) as tools:
        await client.responses.create(model="llama-tiny", input="hi", background=True,
                                      tools=[{"type": "web_search"}])
    assert tools.value.param == "tools"
    with pytest.raises(openai.BadRequestError) as bad:  # the gateway's own refusal, its field named in OpenAI's terms
        await client.responses.create(model="llama-tiny", input="hi", background=True, top_p=7.0)
    assert bad.value.param == "top_p" and bad.value.type == "invalid_request_error"
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve("resp_123456789")
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve("nonsense")
    async with openai.AsyncOpenAI(base_url=f"{stack.url}/openai/v1", api_key="tg_nope", max_retries=0) as stranger:
        with pytest.raises(openai.AuthenticationError) as denied:
            await stranger.responses.create(model="llama-tiny", input="hi", background=True)
    assert denied.value.code == "invalid_api_key"
    async with httpx.AsyncClient(base_url=stack.url, headers=stack.headers()) as raw:
        body = (await raw.get("/openai/v1/nothing-here")).json()
    assert set(body["error"]) == {"message", "type", "param", "code"}


async def test_a_background_response_runs_to_completed(client: openai.AsyncOpenAI) -> None:
    made = await client.responses.create(
        model="llama-tiny", input="Tell me a story.", instructions="Be brief.", background=True, max_output_tokens=24,
        temperature=0, metadata={"order": "42"},
    )
    assert made.id.startswith("resp_") and made.status == "queued" and made.background
    assert made.metadata == {"order": "42"} and made.instructions == "Be brief."
    done = await finished(client, made.id)
    assert done.status in ("completed", "incomplete"), done
    assert done.output_text and done.usage is not None
    assert done.usage.input_tokens > 0 and 0 < done.usage.output_tokens <= 24
    assert done.usage.total_tokens == done.usage.input_tokens + done.usage.output_tokens
    if done.status == "incomplete":
        assert done.incomplete_details is not None and done.incomplete_details.reason == "max_output_tokens"
    with pytest.raises(openai.BadRequestError):  # a finished response cannot be cancelled
        await client.responses.cancel(made.id)


async def test_cancel_a_queued_response(client: openai.AsyncOpenAI) -> None:
    made = await client.responses.create(model="llama-held", input="never runs", background=True)
    cancelled = await client.responses.cancel(made.id)
    assert cancelled.status == "cancelled"
    assert (await client.responses.retrieve(made.id)).status == "cancelled"
    events = [e async for e in await client.responses.retrieve(made.id, stream=True)]
    assert [e.type for e in events] == ["response.created", "response.cancelled"]


async def test_a_stream_resumed_after_a_dropped_connection_misses_and_repeats_nothing(
    client: openai.AsyncOpenAI,
) -> None:
    made = await client.responses.create(
        model="llama-tiny", input="Count slowly.", background=True, max_output_tokens=200, temperature=0,
    )
    seen: list[Any] = []
    first = await client.responses.retrieve(made.id, stream=True)
    async for event in first:
        seen.append(event)
        if (
            event.type == "response.output_text.delta"
            and sum(e.type == "response.output_text.delta" for e in seen) == 3
        ):
            break  # the connection drops mid-stream
    await first.close()
    assert seen and seen[-1].type == "response.output_text.delta"
    resumed = await client.responses.retrieve(made.id, stream=True, starting_after=seen[-1].sequence_number)
    seen += [event async for event in resumed]
    numbers = [e.sequence_number for e in seen]
    assert numbers == list(range(len(seen)))  # no gap, no repeat
    types = [e.type for e in seen]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[-1] in ("response.completed", "response.incomplete")
    text = "".join(e.delta for e in seen if e.type == "response.output_text.delta")
    done = await client.responses.retrieve(made.id)
    assert text == done.output_text and text
    assert next(e for e in seen if e.type == "response.output_text.done").text == text
    # the whole stream again, after the end, is the same events
    again = [e async for e in await client.responses.retrieve(made.id, stream=True)]
    assert [(e.type, e.sequence_number) for e in again] == [(e.type, e.sequence_number) for e in seen]


def batch_lines(n: int) -> bytes:
    lines = []
    for i in range(n):
        body: dict[str, Any] = {"model": "llama-tiny", "input": f"Say {i}.", "max_output_tokens": 8, "temperature": 0}
        if i == 17:
            body["top_p"] = 5  # refused by the gateway: the line lands in the error file
        lines.append({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/responses", "body": body})
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


async def test_a_100_line_batch_completes_with_output_and_error_files(client: openai.AsyncOpenAI) -> None:
    data = batch_lines(100)
    uploaded = await client.files.create(file=("requests.jsonl", data), purpose="batch")
    assert uploaded.id.startswith("file-") and uploaded.bytes == len(data) and uploaded.purpose == "batch"
    assert (await client.files.retrieve(uploaded.id)).filename == "requests.jsonl"
    assert (await client.files.content(uploaded.id)).content == data
    assert uploaded.id in {f.id async for f in client.files.list(purpose="batch")}

    batch = await client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/responses", completion_window="24h", metadata={"run": "nightly"},
    )
    assert batch.status == "validating" and batch.input_file_id == uploaded.id

    async def ended() -> bool:
        return (await client.batches.retrieve(batch.id)).status in ("completed", "failed", "expired", "cancelled")

    await wait_for(ended, within=240)
    done = await client.batches.retrieve(batch.id)
    assert done.status == "completed", done
    assert done.request_counts is not None
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (100, 99, 1)
    assert done.output_file_id and done.error_file_id and done.metadata == {"run": "nightly"}
    output = [json.loads(line) for line in (await client.files.content(done.output_file_id)).text.splitlines()]
    assert sorted(line["custom_id"] for line in output) == sorted(f"req-{i}" for i in range(100) if i != 17)
    for line in output:
        response = line["response"]
        assert response["status_code"] == 200 and response["body"]["object"] == "response"
        assert (
            response["body"]["status"] in ("completed", "incomplete")
            and response["body"]["output"][0]["content"][0]["text"]
        )
    [error] = [json.loads(line) for line in (await client.files.content(done.error_file_id)).text.splitlines()]
    assert error["custom_id"] == "req-17" and error["response"]["status_code"] == 400
    assert error["response"]["body"]["error"]["param"] == "top_p"
    assert batch.id in {b.id async for b in client.batches.list()}


async def test_a_chat_completions_batch_and_its_cancel(client: openai.AsyncOpenAI) -> None:
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "llama-held", "messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": 4}}
             for i in range(5)]
    lines.append({"custom_id": "c5", "method": "POST", "url": "/v1/responses", "body": {}})  # not the batch's endpoint
    data = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
    uploaded = await client.files.create(file=("chat.jsonl", data), purpose="batch")
    batch = await client.batches.create(
        input_file_id=uploaded.id,
        endpoint="/v1/chat/completions",
        completion_window="1h",  # type: ignore[arg-type]
    )

    async def ingested() -> bool:
        got = await client.batches.retrieve(batch.id)
        return got.status == "in_progress"

    await wait_for(ingested, within=30)
    cancelled = await client.batches.cancel(batch.id)
    assert cancelled.status in ("cancelling", "cancelled")

    async def ended() -> bool:
        return (await client.batches.retrieve(batch.id)).status == "cancelled"

    await wait_for(ended, within=30)
    done = await client.batches.retrieve(batch.id)
    assert done.request_counts is not None and done.request_counts.failed == 6 and done.output_file_id is None
    assert done.error_file_id is not None
    errors = {line["custom_id"]: line for line in
              (json.loads(raw) for raw in (await client.files.content(done.error_file_id)).text.splitlines())}
    assert errors["c5"]["error"]["code"] == "invalid_url"
    assert {errors[f"c{i}"]["error"]["code"] for i in range(5)} == {"batch_cancelled"}
