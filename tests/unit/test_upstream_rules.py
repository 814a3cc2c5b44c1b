"""The upstream backend's pure rules: a task's parameters as a chat completion's, and what an upstream error means."""

from __future__ import annotations

import httpx2
import openai
import pytest

from services.worker.upstream import failure_of, request_body
from taskgate.config import ModelSpec

_REQUEST = httpx2.Request("POST", "http://upstream.invalid/v1/chat/completions")


def _status(code: int) -> openai.APIStatusError:
    response = httpx2.Response(code, request=_REQUEST, json={"error": {"message": "no"}})
    return openai.AsyncOpenAI(api_key="k", base_url="http://upstream.invalid/v1")._make_status_error_from_response(response)


def test_parameters_map_to_the_chat_completion_and_absent_ones_stay_the_servers() -> None:
    params = {"max_output_tokens": 7, "temperature": 0.5, "stop": ("\n",), "seed": None}
    body = request_body("up", [{"role": "user", "content": "hi", "name": "x"}], params)
    assert body == {
        "model": "up",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 7,
        "temperature": 0.5,
        "stop": ["\n"],
    }


@pytest.mark.parametrize(
    ("status", "code", "retryable"),
    [
        (429, "UPSTREAM_RATE_LIMITED", True),
        (500, "UPSTREAM_ERROR", True),
        (503, "UPSTREAM_ERROR", True),
        (408, "UPSTREAM_ERROR", True),
        (400, "UPSTREAM_REJECTED", False),
        (401, "UPSTREAM_REJECTED", False),
        (404, "UPSTREAM_REJECTED", False),
        (422, "UPSTREAM_REJECTED", False),
    ],
)
def test_statuses_are_retryable_or_final(status: int, code: str, retryable: bool) -> None:
    failure = failure_of(_status(status))
    assert (failure.code, failure.retryable) == (code, retryable)
    assert str(status) in str(failure)


def test_connection_errors_and_timeouts_and_stream_errors_are_retryable() -> None:
    refused = openai.APIConnectionError(request=_REQUEST)
    refused.__cause__ = ConnectionRefusedError("refused")
    assert (failure_of(refused).code, failure_of(refused).retryable) == ("UPSTREAM_UNAVAILABLE", True)
    assert "ConnectionRefusedError" in str(failure_of(refused))
    timeout = openai.APITimeoutError(request=_REQUEST)
    assert (failure_of(timeout).code, failure_of(timeout).retryable) == ("UPSTREAM_TIMEOUT", True)
    mid_stream = openai.APIError("model crashed", _REQUEST, body={"message": "model crashed"})
    assert (failure_of(mid_stream).code, failure_of(mid_stream).retryable) == ("UPSTREAM_ERROR", True)


def test_an_upstream_entry_needs_its_base_url() -> None:
    with pytest.raises(ValueError, match="base_url"):
        ModelSpec(kind="openai-compatible")
    assert ModelSpec(kind="openai-compatible", base_url="http://h:1/v1").upstream_max_requests >= 1
