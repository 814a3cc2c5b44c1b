"""The upstream backend against a real OpenAI-compatible server (llama.cpp's, serving the tiny chat model): deltas
streamed as they come, usage counted, cancel closing the stream, an upstream that is down or refuses the key."""

from __future__ import annotations

import asyncio

import pytest

from services.worker.upstream import Upstream, UpstreamFailure
from taskgate.config import ModelSpec
from taskgate_local.embedded import free_port
from tests.support.harness import wait_for
from tests.support.llamaserver import LlamaServer

MESSAGES = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "hello model, the answer?"},
]


def _upstream(server: LlamaServer, **changes: object) -> Upstream:
    spec = ModelSpec(
        kind="openai-compatible",
        base_url=server.base_url,
        upstream_model=server.alias,
        api_key_env="TINY_UPSTREAM_KEY",
        task_types=["chat"],
        **changes,  # type: ignore[arg-type]
    )
    return Upstream("tiny-upstream", spec, environ={"TINY_UPSTREAM_KEY": server.api_key or ""})


async def test_a_chat_streams_its_deltas_and_ends_with_a_reason_and_its_tokens(llama_server: LlamaServer) -> None:
    upstream = _upstream(llama_server)
    deltas: list[str] = []
    try:
        done = await upstream.chat(MESSAGES, {"max_output_tokens": 12, "temperature": 0.0, "seed": 3}, deltas.append)
    finally:
        await upstream.close()
    assert done.finish_reason in ("length", "stop")
    assert done.text == "".join(deltas) and done.text
    assert len(deltas) > 1, "streamed piece by piece, not in one answer"
    # llama.cpp's server sends no usage in a stream: the chunks with text are counted (a token with no text of its own,
    # a byte piece completed by the next, has none, so the count is at most the tokens generated)
    assert not done.reported and done.output_tokens == len(deltas) <= 12


async def test_the_same_seed_gives_the_same_text(llama_server: LlamaServer) -> None:
    upstream = _upstream(llama_server)
    try:
        texts = [
            (
                await upstream.chat(MESSAGES, {"max_output_tokens": 8, "temperature": 1.0, "seed": 11}, lambda _: None)
            ).text
            for _ in range(2)
        ]
    finally:
        await upstream.close()
    assert texts[0] == texts[1]


async def test_cancelling_closes_the_stream_and_the_server_stops_generating(llama_server: LlamaServer) -> None:
    upstream = _upstream(llama_server)
    first = asyncio.Event()
    deltas: list[str] = []

    def on_delta(text: str) -> None:
        deltas.append(text)
        first.set()

    logged = llama_server.log.read_text(errors="replace").count("Disconnected from client")
    try:
        # long enough to run for seconds: the tiny model's end-of-sequence token is made rare with a stop it never meets
        chat = asyncio.create_task(
            upstream.chat(MESSAGES, {"max_output_tokens": 1500, "temperature": 1.0, "seed": 5}, on_delta)
        )
        await asyncio.wait_for(first.wait(), 30)
        chat.cancel()
        with pytest.raises(asyncio.CancelledError):
            await chat
        # the server saw its client leave (it logs it as it drops the generation) ...
        await wait_for(
            lambda: llama_server.log.read_text(errors="replace").count("Disconnected from client") > logged, within=30
        )
        # ... and is free at once for the next request, which it serves one at a time
        after = await asyncio.wait_for(upstream.chat(MESSAGES, {"max_output_tokens": 2}, lambda _: None), 30)
    finally:
        await upstream.close()
    assert after.output_tokens <= 2


async def test_an_upstream_that_is_down_is_a_retryable_failure(llama_server: LlamaServer) -> None:
    down = LlamaServer(llama_server.base, llama_server.model, alias="x", port=free_port())  # nothing listens there
    upstream = Upstream(
        "down", ModelSpec(kind="openai-compatible", base_url=down.base_url, upstream_connect_timeout_seconds=2)
    )
    try:
        with pytest.raises(UpstreamFailure) as failed:
            await upstream.chat(MESSAGES, {}, lambda _: None)
    finally:
        await upstream.close()
    assert failed.value.retryable and failed.value.code == "UPSTREAM_UNAVAILABLE"


async def test_a_refused_key_is_a_final_failure(llama_server: LlamaServer) -> None:
    spec = ModelSpec(kind="openai-compatible", base_url=llama_server.base_url, api_key_env="WRONG_KEY")
    upstream = Upstream("refused", spec, environ={"WRONG_KEY": "sk-not-this-one"})
    try:
        with pytest.raises(UpstreamFailure) as failed:
            await upstream.chat(MESSAGES, {}, lambda _: None)
    finally:
        await upstream.close()
    assert not failed.value.retryable and failed.value.code == "UPSTREAM_REJECTED" and "401" in str(failed.value)


def test_a_missing_key_variable_is_refused_at_load() -> None:
    spec = ModelSpec(kind="openai-compatible", base_url="http://127.0.0.1:1/v1", api_key_env="NOT_SET_ANYWHERE")
    with pytest.raises(ValueError, match="NOT_SET_ANYWHERE"):
        Upstream("m", spec, environ={})
