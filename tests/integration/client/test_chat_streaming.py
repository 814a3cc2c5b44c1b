"""End to end on the real tiny language model: a chat task's answer streams over WatchTask (dropped mid-way and
resumed), over SSE and through the CLI, and the deltas put together equal the final inline text."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from taskgate.config import ModelSpec, Settings
from taskgate.runtime import Backends
from taskgate_api.v1 import events_pb2, events_pb2_grpc, gateway_pb2, gateway_pb2_grpc, task_pb2
from taskgate_client import Output, TextAssembler
from tests.support import harness
from tests.support.harness import HttpStack
from tests.support.stacks import Cli

MODEL = "llama-tiny"


@pytest.fixture
def settings(settings: Settings, tiny_lm: Path) -> Settings:
    spec = ModelSpec(kind="transformers", path=tiny_lm, max_sequences=4, max_input_tokens=4096, max_output_tokens=6000)
    return settings.model_copy(update={"models": {**settings.models, MODEL: spec}, "stream_keepalive_seconds": 1.0})


@pytest.fixture
async def stack(settings: Settings, backends: Backends) -> AsyncIterator[HttpStack]:
    async with harness.http_stack(settings, backends, worker_models=[MODEL]) as s:
        yield s


def assembled(chunks: list[Any]) -> str:
    text = TextAssembler()
    for chunk in chunks:
        text.feed(Output.from_proto(chunk))
    return text.text


async def sse_text(client: httpx.AsyncClient, task_id: str) -> str:
    """The answer as the SSE stream delivers it (every `output` event until the stream ends)."""
    chunks = []
    async with client.stream("GET", f"/v1/tasks/{task_id}/events") as response:
        assert response.status_code == 200
        event, data = "", ""
        async for line in response.aiter_lines():
            if line.startswith("event:"):
                event = line.partition(":")[2].strip()
            elif line.startswith("data:"):
                data = line.partition(":")[2].strip()
            elif not line and event == "output":
                chunk = json.loads(data)
                chunks.append(Output(task_id=chunk["task_id"], sequence=int(chunk["sequence"]),
                                     attempt=int(chunk.get("attempt", 0)), kind="text", text=chunk.get("text", ""),
                                     offset=int(chunk.get("offset", 0))))
                event = ""
    text = TextAssembler()
    for c in chunks:
        text.feed(c)
    return text.text


async def test_a_chat_answer_streams_over_watch_task_sse_and_the_cli_equal_to_its_final_text(
    stack: HttpStack, backends: Backends, tmp_path: Path
) -> None:
    md = (("authorization", f"Bearer {stack.api_key}"),)
    async with (
        grpc.aio.insecure_channel(f"127.0.0.1:{stack.submit.port}") as gw_channel,
        grpc.aio.insecure_channel(f"127.0.0.1:{stack.notifier.port}") as ev_channel,
        httpx.AsyncClient(base_url=stack.url, headers=stack.headers(), timeout=60) as http,
    ):
        gateway = gateway_pb2_grpc.TaskGatewayStub(gw_channel)
        events = events_pb2_grpc.TaskEventsStub(ev_channel)
        body = {"task_type": "chat", "model_id": MODEL, "chat": {
            "messages": [{"role": "user", "content": "Write a long story about a fox."}],
            "max_output_tokens": 300, "temperature": 0.8, "seed": 7}}
        made = await http.post("/v1/tasks", json=body)
        assert made.status_code == 201, made.text
        task_id = made.json()["task"]["id"]
        over_sse = asyncio.create_task(sse_text(http, task_id))
        # WatchTask: a few chunks, the connection dropped, the rest from where it stopped
        call = events.WatchTask(events_pb2.WatchTaskRequest(task_id=task_id, include_output=True), metadata=md)
        first: list[Any] = []
        version = 0
        async with asyncio.timeout(120):
            while len(first) < 3:
                msg = await call.read()
                assert msg is not grpc.aio.EOF, "the stream ended before three chunks"
                kind = msg.WhichOneof("kind")
                if kind == "output":
                    first.append(msg.output)
                elif kind == "snapshot":
                    version = msg.snapshot.version
                elif kind == "event":
                    version = msg.event.version
        call.cancel()
        resumed = events.WatchTask(events_pb2.WatchTaskRequest(
            task_id=task_id, include_output=True, after_version=version, after_output_sequence=first[-1].sequence,
        ), metadata=md)
        rest = []
        last_event = None
        async with asyncio.timeout(180):
            async for msg in resumed:
                if msg.WhichOneof("kind") == "output":
                    rest.append(msg.output)
                elif msg.WhichOneof("kind") == "event":
                    last_event = msg.event
        # the stream ended with it
        assert last_event is not None and last_event.to_status == task_pb2.TASK_STATUS_SUCCEEDED
        final = (await gateway.GetTask(gateway_pb2.GetTaskRequest(task_id=task_id), metadata=md)).task
        assert final.status == task_pb2.TASK_STATUS_SUCCEEDED, final
        answer = final.text.text
        assert answer and not final.text.truncated
        sequences = [c.sequence for c in first + rest]
        assert sequences == sorted(set(sequences))  # in order, none twice
        assert assembled(first + rest) == answer  # no delta missed across the reconnect
        assert await asyncio.wait_for(over_sse, 60) == answer

    # the CLI streams the answer to the terminal as it is generated
    env = {k: v for k, v in os.environ.items() if not k.startswith("TASKGATE_")} | {
        "TASKGATE_ADDRESS": f"127.0.0.1:{stack.submit.port}",
        "TASKGATE_EVENTS_ADDRESS": f"127.0.0.1:{stack.notifier.port}",
        "TASKGATE_ADMIN_ADDRESS": f"127.0.0.1:{stack.scheduler.port}",
        "TASKGATE_API_KEY": stack.api_key,
        "TASKGATE_STATE_DIR": str(tmp_path / "state"),
        "PYTHONPATH": str(harness.ROOT),  # this checkout's CLI, whatever the environment has installed
    }
    cli = Cli(env, tmp_path, stack.settings, backends)
    (tmp_path / "doc.txt").write_text("The fox jumped over the fence.\n")
    ran = await cli("chat", "Summarise this.", "--file", "doc.txt", "--system", "Be brief.", "--model", MODEL,
                    "--max-tokens", "40", "--seed", "3")
    assert ran.code == 0, ran.err
    assert ran.err.startswith("task ")
    cli_task = ran.err.split()[1]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{stack.submit.port}") as channel:
        done = (await gateway_pb2_grpc.TaskGatewayStub(channel).GetTask(
            gateway_pb2.GetTaskRequest(task_id=cli_task), metadata=md)).task
    assert ran.out == done.text.text + "\n"
    asked = [(m.role, m.content) for m in done.chat.messages] or [("user", done.prompt)]
    assert "fox jumped" in asked[-1][1] and asked[-1][1].startswith("Summarise this.")  # --file joins the message
    uploaded = await backends.pool.fetch("SELECT sha256, chars FROM task_input WHERE content_type = 'text/plain'")
    assert [(r["sha256"], r["chars"]) for r in uploaded] == [  # uploaded as a text attachment, not sent inline
        (hashlib.sha256(b"The fox jumped over the fence.\n").hexdigest(), 31)]
    waited = await cli("chat", "Hello", "--model", MODEL, "--max-tokens", "10", "--seed", "1", "--wait")
    assert waited.code == 0 and waited.out.strip()
