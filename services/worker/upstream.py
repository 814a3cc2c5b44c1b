"""The upstream backend (`kind: "openai-compatible"`): a chat task forwarded to an OpenAI-compatible server a team
already runs (vLLM, SGLang, TGI, llama.cpp's server, Ollama), streamed, each delta handed on as it arrives.

The official `openai` client speaks the protocol (server-sent events, error bodies, a stream's error event); this
module decides what its outcomes mean for the task: 429, 408, 5xx, a refused or cut connection and a timeout are
retryable, any other status is final. Cancelling the awaiting coroutine closes the HTTP response, which is how the
upstream hears that the client left and stops generating. One worker opens at most `upstream_max_requests` requests
to a model's upstream at once; the rest wait here, in arrival order.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import openai

from taskgate.config import ModelSpec

OnDelta = Callable[[str], None]

# statuses a later attempt may get past: the server busy, overloaded, restarting or behind a gateway that timed out
_RETRYABLE_STATUSES = frozenset({408, 409, 425, 429})


class UpstreamFailure(Exception):
    """An upstream request that failed: `code` is what the task records, `retryable` whether another attempt may
    help."""

    def __init__(self, code: str, message: str, *, retryable: bool) -> None:
        super().__init__(message)
        self.code = code
        self.retryable = retryable


@dataclass(frozen=True, slots=True)
class Generated:
    """A finished chat completion: its text, why it ended, and its tokens (`reported`: the server's own count;
    otherwise output tokens are the streamed content chunks and input tokens are unknown, 0)."""

    text: str
    finish_reason: str
    input_tokens: int
    output_tokens: int
    reported: bool


def request_body(model: str, messages: Sequence[Mapping[str, str]], params: Mapping[str, Any]) -> dict[str, Any]:
    """The chat completion's arguments from a task's parameters (a sampling parameter left out is the server's
    default)."""
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": m["role"], "content": m["content"]} for m in messages],
    }
    for ours, theirs in (
        ("max_output_tokens", "max_tokens"),
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("seed", "seed"),
    ):
        if params.get(ours) is not None:
            body[theirs] = params[ours]
    if params.get("stop"):
        body["stop"] = list(params["stop"])
    return body


def failure_of(exc: openai.OpenAIError) -> UpstreamFailure:
    """What an error of the openai client means for the task."""
    if isinstance(exc, openai.APIStatusError):
        status = exc.status_code
        retryable = status >= 500 or status in _RETRYABLE_STATUSES
        code = "UPSTREAM_RATE_LIMITED" if status == 429 else "UPSTREAM_ERROR" if retryable else "UPSTREAM_REJECTED"
        return UpstreamFailure(code, f"upstream answered {status}: {exc.message}", retryable=retryable)
    if isinstance(exc, openai.APITimeoutError):  # before APIConnectionError, its base class
        return UpstreamFailure("UPSTREAM_TIMEOUT", "the upstream did not answer in time", retryable=True)
    if isinstance(exc, openai.APIConnectionError):
        cause = exc.__cause__ or exc
        return UpstreamFailure(
            "UPSTREAM_UNAVAILABLE", f"cannot reach the upstream: {type(cause).__name__}: {cause}", retryable=True
        )
    if isinstance(exc, openai.APIError):  # an error event inside the stream: the server failed mid-generation
        return UpstreamFailure("UPSTREAM_ERROR", f"the upstream failed while streaming: {exc.message}", retryable=True)
    return UpstreamFailure("UPSTREAM_PROTOCOL", f"{type(exc).__name__}: {exc}", retryable=False)


class Upstream:
    """One model entry's upstream server, as one worker uses it."""

    def __init__(self, model_id: str, spec: ModelSpec, environ: Mapping[str, str] = os.environ) -> None:
        if spec.base_url is None:
            raise ValueError(f"model {model_id!r} has no base_url")
        key = None
        if spec.api_key_env is not None:
            key = environ.get(spec.api_key_env)
            if not key:
                raise ValueError(f"model {model_id!r}: its API key variable {spec.api_key_env} is not set")
        self.model_id = model_id
        self.spec = spec
        self.upstream_model = spec.upstream_model or model_id
        # retries are the task's (backoff, counted, visible), never hidden inside one attempt
        self.client = openai.AsyncOpenAI(
            base_url=spec.base_url,
            api_key=key or "unused",  # the client insists on one; a server without keys ignores it
            max_retries=0,
            timeout=openai.Timeout(spec.upstream_read_timeout_seconds, connect=spec.upstream_connect_timeout_seconds),
        )
        self._open: asyncio.Semaphore | None = None  # made on the worker's loop, at first use

    async def chat(
        self, messages: Sequence[Mapping[str, str]], params: Mapping[str, Any], on_delta: OnDelta
    ) -> Generated:
        """Streams one completion, calling `on_delta` with each piece of text as it arrives; raises UpstreamFailure.
        Cancelled, it closes the stream (the upstream stops generating) and lets CancelledError through."""
        if self._open is None:
            self._open = asyncio.Semaphore(self.spec.upstream_max_requests)
        async with self._open:
            try:
                body = request_body(self.upstream_model, messages, params)
                return await self._stream(body, on_delta)
            except openai.OpenAIError as exc:
                raise failure_of(exc) from exc

    async def _stream(self, body: dict[str, Any], on_delta: OnDelta) -> Generated:
        if self.spec.upstream_stream_usage:
            body["stream_options"] = {"include_usage": True}
        parts: list[str] = []
        chunks = 0
        finish: str | None = None
        usage: Any = None
        # the server's own fields go as the client's extra_body (its create() takes only OpenAI's); a task's own win
        extra = {k: v for k, v in self.spec.upstream_extra_body.items() if k not in body}
        stream = await self.client.chat.completions.create(**body, stream=True, extra_body=extra or None)
        async with stream:  # leaving it, however, closes the response: a cancelled task's generation stops upstream
            async for chunk in stream:
                if chunk.usage is not None:
                    usage = chunk.usage
                for choice in chunk.choices:
                    if choice.index != 0:
                        continue
                    if choice.delta is not None and choice.delta.content:
                        parts.append(choice.delta.content)
                        chunks += 1
                        on_delta(choice.delta.content)
                    if choice.finish_reason is not None:
                        finish = choice.finish_reason
        if finish is None:  # ended without saying why: the connection was cut or the server gave up
            raise UpstreamFailure(
                "UPSTREAM_STREAM_CUT", "the upstream's stream ended before its finish reason", retryable=True
            )
        if usage is not None:
            return Generated("".join(parts), finish, int(usage.prompt_tokens), int(usage.completion_tokens), True)
        return Generated("".join(parts), finish, 0, chunks, False)

    async def close(self) -> None:
        """Closes the client's connections."""
        await self.client.close()
