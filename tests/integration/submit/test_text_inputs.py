"""Text attachments of chat tasks (#34): uploaded like an input image (UploadInput with content_type text/plain, or
POST /v1/inputs), content-addressed per tenant, named by a chat message's content_sha256, appended to its content at
admission and counted there like inline text, and covered by the inputs' retention."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from services.scheduler.retention import Retention, RetentionScan
from services.scheduler.scans import Action, ScanContext
from taskgate.config import ModelSpec, Settings
from taskgate.results import ResultNotFound, result_store
from taskgate.runtime import Backends
from taskgate_api.v1 import gateway_pb2, task_pb2
from tests.support import harness
from tests.support.factories import key_for
from tests.support.harness import HttpStack, outcome, violations

MODEL = "llama-tiny"
DOCUMENT = "def review(diff):\n\treturn value  # the error test\r\n" * 200 + "né ✓\n"


@pytest.fixture
def settings(settings: Settings, tiny_lm: Path) -> Settings:
    spec = ModelSpec(kind="transformers", path=tiny_lm, max_input_tokens=100_000)
    return settings.model_copy(update={"models": {**settings.models, MODEL: spec}})


async def upload(stub: Any, md: Any, data: bytes, *, content_type: str = "text/plain", part: int = 1000) -> Any:
    async def parts() -> AsyncIterator[gateway_pb2.UploadInputRequest]:
        for offset in range(0, max(len(data), 1), part):
            msg = gateway_pb2.UploadInputRequest(data=data[offset : offset + part])
            if offset == 0:
                msg.content_type = content_type
            yield msg

    return await stub.UploadInput(parts(), metadata=md, timeout=10)


def chat(*turns: task_pb2.ChatMessage, **fields: Any) -> gateway_pb2.SubmitTaskRequest:
    return gateway_pb2.SubmitTaskRequest(
        task_type="chat", model_id=MODEL, chat=task_pb2.ChatParams(messages=turns, seed=1), **fields
    )


async def test_a_chat_task_naming_an_upload_is_the_same_request_as_its_text_inline(
    stub: Any, backends: Backends
) -> None:
    md = await key_for(backends, max_pending=10)
    data = DOCUMENT.encode()
    text = (await upload(stub, md, data)).text
    assert (text.sha256, text.size_bytes, text.chars, text.content_type) == (
        hashlib.sha256(data).hexdigest(), len(data), len(DOCUMENT), "text/plain")
    row = await backends.pool.fetchrow("SELECT * FROM task_input WHERE sha256 = $1", text.sha256)
    assert (row["content_type"], row["chars"], row["width"]) == ("text/plain", len(DOCUMENT), None)
    assert (await upload(stub, md, data)).text == text  # content-addressed: the same upload again is the same input

    made = await stub.SubmitTask(chat(
        task_pb2.ChatMessage(role="system", content="Be brief."),
        task_pb2.ChatMessage(role="user", content="Review this:", content_sha256=text.sha256),
    ), metadata=md, timeout=10)
    assert made.created and made.task.usage.input_tokens > 1000  # the attachment counted at admission
    payload = await backends.pool.fetchval("SELECT request_payload FROM task WHERE id = $1", int(made.task.id))
    assert payload["messages"][1]["content"] == "Review this:\n\n" + DOCUMENT
    # the same conversation inline derives the same key: the very same task, counted the same
    inline = await stub.SubmitTask(chat(
        task_pb2.ChatMessage(role="system", content="Be brief."),
        task_pb2.ChatMessage(role="user", content="Review this:\n\n" + DOCUMENT),
    ), metadata=md, timeout=10)
    assert (inline.created, inline.task.id, inline.task.usage.input_tokens) == (
        False,
        made.task.id,
        made.task.usage.input_tokens,
    )
    # a message that is the attachment alone
    alone = await stub.SubmitTask(
        chat(task_pb2.ChatMessage(role="user", content_sha256=text.sha256)), metadata=md, timeout=10
    )
    payload = await backends.pool.fetchval("SELECT request_payload FROM task WHERE id = $1", int(alone.task.id))
    assert alone.created and payload["messages"] == [{"role": "user", "content": DOCUMENT}]


async def test_an_attachment_the_tenant_does_not_hold_is_refused_naming_its_field(
    stub: Any, backends: Backends
) -> None:
    md, other = await key_for(backends, max_pending=10), await key_for(backends, "tenant-b", max_pending=10)
    theirs = (await upload(stub, other, b"their document")).text.sha256
    field = {"chat.messages[0].content_sha256"}
    for sha256 in (theirs, "0" * 64, "not-a-sha256"):
        code, details, _ = await outcome(
            stub.SubmitTask(
                chat(task_pb2.ChatMessage(role="user", content="x", content_sha256=sha256)), metadata=md, timeout=10
            )
        )
        assert (code.name, violations(details)) == ("INVALID_ARGUMENT", field), sha256
    assert await backends.pool.fetchval("SELECT count(*) FROM task") == 0


@pytest.mark.parametrize(
    ("data", "content_type", "field"),
    [(b"\xff\xfe not UTF-8", "text/plain", "data"), (b"", "text/plain", "data"), (b"nul \x00", "text/plain", "data"),
     (b"x" * 10, "application/pdf", "content_type")],
)
async def test_a_text_upload_that_cannot_be_an_attachment_is_refused(
    stub: Any, backends: Backends, data: bytes, content_type: str, field: str
) -> None:
    md = await key_for(backends, max_pending=10)
    code, details, _ = await outcome(upload(stub, md, data, content_type=content_type))
    assert (code.name, violations(details)) == ("INVALID_ARGUMENT", {field})
    assert await backends.pool.fetchval("SELECT count(*) FROM task_input") == 0


async def test_a_text_longer_than_max_input_chars_is_refused(stub: Any, backends: Backends, settings: Settings) -> None:
    md = await key_for(backends, max_pending=10)
    code, details, _ = await outcome(upload(stub, md, b"a" * (settings.max_input_chars + 1), part=1 << 20))
    assert (code.name, violations(details)) == ("INVALID_ARGUMENT", {"data"})


@pytest.fixture
async def http(settings: Settings, backends: Backends) -> AsyncIterator[tuple[HttpStack, httpx.AsyncClient]]:
    async with harness.http_stack(settings, backends) as stack, httpx.AsyncClient(
        base_url=stack.url, headers=stack.headers(), timeout=20
    ) as client:
        yield stack, client


async def test_over_http_a_text_upload_is_named_by_a_chat_message(http: tuple[HttpStack, httpx.AsyncClient]) -> None:
    _, client = http
    stored = await client.post(
        "/v1/inputs", content=DOCUMENT.encode(), headers={"content-type": "text/plain; charset=utf-8"}
    )
    assert stored.status_code == 201, stored.text
    text = stored.json()["text"]
    assert text["sha256"] == hashlib.sha256(DOCUMENT.encode()).hexdigest() and int(text["chars"]) == len(DOCUMENT)
    body = {"task_type": "chat", "model_id": MODEL,
            "chat": {"messages": [{"role": "user", "content": "Review:", "content_sha256": text["sha256"]}]}}
    made = await client.post("/v1/tasks", json=body)
    assert made.status_code == 201, made.text
    assert int(made.json()["task"]["usage"]["input_tokens"]) > 1000


@pytest.fixture
def scan_context(settings: Settings, backends: Backends) -> Iterator[ScanContext]:
    yield ScanContext(settings=settings, pool=backends.pool, bus=backends.bus)


async def test_retention_deletes_a_text_attachment_after_its_last_use(
    stub: Any, backends: Backends, settings: Settings, scan_context: ScanContext
) -> None:
    md = await key_for(backends, max_pending=10)
    old, recent = (await upload(stub, md, b"an old document")).text, (await upload(stub, md, b"a recent one")).text
    await stub.SubmitTask(
        chat(task_pb2.ChatMessage(role="user", content_sha256=recent.sha256)), metadata=md, timeout=10
    )
    week_later = datetime.now(UTC) + timedelta(days=8)
    await backends.pool.execute(
        "UPDATE task_input SET last_used_at = now() + interval '2 days' WHERE sha256 = $1", recent.sha256
    )
    purged = await RetentionScan(scan_context).purge(Retention(inputs=7 * 86400.0), now=week_later, limit=100)
    assert purged.actions[Action.PURGE_INPUT] == 1
    assert [r["sha256"] for r in await backends.pool.fetch("SELECT sha256 FROM task_input")] == [recent.sha256]
    store = result_store(settings, backends.bus)
    with pytest.raises(ResultNotFound):
        async for _ in store.read(store.uri_of(f"inputs/{old.sha256}.txt")):
            pass
    code, details, _ = await outcome(
        stub.SubmitTask(chat(task_pb2.ChatMessage(role="user", content_sha256=old.sha256)), metadata=md, timeout=10)
    )
    assert (code.name, violations(details)) == ("INVALID_ARGUMENT", {"chat.messages[0].content_sha256"})
