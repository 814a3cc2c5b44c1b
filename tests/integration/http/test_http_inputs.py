"""Hostile input to the HTTP face: any route with any path, query, headers and body is answered below 500, and the
bad inputs a review found answered 500 (deeply nested JSON, Unicode digits in integer headers) are a 400 naming
their field, on the API and the dashboard alike."""

from __future__ import annotations

import json
import os
import re
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from taskgate.config import ModelSpec, Settings
from taskgate.runtime import Backends
from tests.support import factories, harness
from tests.support.harness import HttpStack

EXAMPLES = hsettings(
    max_examples=int(os.environ.get("TASKGATE_HYPOTHESIS_EXAMPLES", "25")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
ROUTES = [
    ("POST", "/v1/tasks:batch"),
    ("POST", "/v1/tasks"),
    ("GET", "/v1/tasks"),
    ("POST", "/v1/tasks/{id}:cancel"),
    ("POST", "/v1/tasks/{id}:regenerate"),
    ("GET", "/v1/tasks/{id}/result"),
    ("GET", "/v1/tasks/{id}/events"),
    ("GET", "/v1/tasks/{id}/previews"),
    ("GET", "/v1/tasks/{id}"),
    ("GET", "/v1/events"),
    ("PUT", "/v1/inputs"),
    ("POST", "/v1/webhook-secret:rotate"),
    ("POST", "/dashboard/actions/replay"),
    ("POST", "/dashboard/actions/drain"),
    ("GET", "/dashboard/state.json"),
    ("POST", "/openai/v1/responses"),
    ("GET", "/openai/v1/responses/resp_{id}"),
    ("POST", "/openai/v1/responses/resp_{id}/cancel"),
    ("POST", "/openai/v1/files"),
    ("GET", "/openai/v1/files"),
    ("GET", "/openai/v1/files/{id}/content"),
    ("POST", "/openai/v1/batches"),
    ("GET", "/openai/v1/batches/{id}"),
    ("POST", "/openai/v1/batches/{id}/cancel"),
]
DIGITS = [
    "0",
    "1",
    "²",
    "³",
    "٣",
    "\uff11",
    "߂",
    " 1",
    "1_0",
    "-1",
    "+1",
    "1e3",
    "9223372036854775807",
    "9223372036854775808",
    "99999999999999999999999",
    "",
]


@pytest.fixture
def settings(settings: Settings) -> Settings:
    models = {**settings.models, "held": ModelSpec(kind="sleep")}  # nobody serves it: its tasks wait QUEUED
    return settings.model_copy(update={"models": models, "default_model": "held", "submits_per_minute": 100_000,
                                       "max_pending_per_tenant": 100_000})


@pytest.fixture
async def stack(settings: Settings, backends: Backends) -> AsyncIterator[HttpStack]:
    async with harness.http_stack(settings, backends) as s:
        yield s


@pytest.fixture
async def signed_in(stack: HttpStack) -> AsyncIterator[tuple[httpx.AsyncClient, str]]:
    """A dashboard session of an operator key and its CSRF token."""
    async with httpx.AsyncClient(base_url=stack.url, timeout=20) as web:
        assert (await web.post("/dashboard/login", data={"key": stack.admin_key})).status_code == 303
        match = re.search(r'<meta name="csrf-token" content="([^"]+)">', (await web.get("/dashboard")).text)
        assert match is not None
        yield web, match.group(1)


def violations(response: httpx.Response) -> set[str]:
    return {v["field"] for d in response.json()["error"]["details"] for v in d.get("field_violations", [])}


async def test_deep_json_bodies_are_400_on_body_on_every_json_route(
    stack: HttpStack, signed_in: tuple[httpx.AsyncClient, str]
) -> None:
    async with httpx.AsyncClient(base_url=stack.url, headers=stack.headers(), timeout=30) as api:
        for path in (
            "/v1/tasks",
            "/v1/tasks:batch",
            "/v1/tasks/1:cancel",
            "/v1/tasks/1:regenerate",
            "/v1/webhook-secret:rotate",
        ):
            for raw in (b"[" * 100_000, b'{"metadata": ' + b"[" * 40 + b"]" * 40 + b"}"):
                got = await api.post(path, content=raw, headers={"content-type": "application/json"})
                assert got.status_code == 400, (path, got.status_code, got.text[:300])
                assert violations(got) == {"body"} and "nested deeper than 32 levels" in got.text, got.text[:300]
        # brackets in a string
        fine = await api.post("/v1/tasks", json={"prompt": "a fox", "metadata": {"k": "[" * 1_000}})
        assert fine.status_code == 201, fine.text
    web, csrf = signed_in
    for raw in (b"[" * 8_000, b'{"task_id": ' + b"[" * 40 + b"]" * 40 + b"}"):
        got = await web.post(
            "/dashboard/actions/replay", content=raw, headers={"x-csrf-token": csrf, "content-type": "application/json"}
        )
        assert got.status_code == 400 and got.json()["message"].startswith("body: nested deeper"), got.text
    for task_id in ("٣", "²", "1" * 25):
        got = await web.post("/dashboard/actions/replay", json={"task_id": task_id}, headers={"x-csrf-token": csrf})
        assert got.status_code == 400 and got.json()["message"].startswith("task_id:"), got.text


async def test_integer_headers_and_queries_take_ascii_digits_only(stack: HttpStack) -> None:
    async with httpx.AsyncClient(base_url=stack.url, headers=stack.headers(), timeout=30) as api:
        made = await api.post("/v1/tasks", json={"prompt": "a fox"})
        task_id = made.json()["task"]["id"]
        for value in ("²", "٣", "1x", "1_0", "9223372036854775808"):
            header = await api.get(f"/v1/tasks/{task_id}/events", headers=[(b"last-event-id", value.encode())])
            assert header.status_code == 400 and violations(header) == {"Last-Event-ID"}, (value, header.text)
            query = await api.get(f"/v1/tasks/{task_id}/events", params={"after_version": value})
            assert query.status_code == 400 and violations(query) == {"after_version"}, (value, query.text)
            size = await api.get("/v1/tasks", params={"page_size": value})
            assert size.status_code == 400 and violations(size) == {"page_size"}, (value, size.text)
        assert (await api.get("/v1/tasks", params={"page_size": "2"})).status_code == 200
        async with api.stream("GET", f"/v1/tasks/{task_id}/events", headers={"last-event-id": "0"}) as fine:
            assert fine.status_code == 200


def _header_value(text: str) -> bytes:
    """What h11 lets a client send as a header value: no CR, LF, NUL or other controls, no surrounding blanks."""
    return bytes(b for b in text.encode() if b >= 0x20 and b != 0x7F).strip(b" \t")


ANY_TEXT = st.one_of(st.sampled_from(DIGITS), factories.any_text(30, surrogates=False))
BODIES = st.one_of(
    st.none(),
    st.binary(max_size=200),
    st.integers(1, 3000).map(lambda n: b"[" * n),
    st.integers(1, 200).map(lambda n: b"{\"prompt\": " + b"[" * n + b"]" * n + b"}"),
    st.recursive(
        st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), ANY_TEXT),
        lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(ANY_TEXT, inner, max_size=3)),
        max_leaves=12,
    ).map(lambda value: json.dumps(value).encode()),
)


@pytest.mark.parametrize("route", ROUTES, ids=[f"{m} {p}" for m, p in ROUTES])
@EXAMPLES
@given(
    task_id=st.one_of(st.just("real"), ANY_TEXT),
    query=st.dictionaries(
        st.sampled_from(
            [
                "after_version",
                "page_size",
                "status",
                "cursor",
                "created_after",
                "created_before",
                "page_token",
                "stream",
                "starting_after",
                "limit",
                "after",
                "purpose",
                "uri",
            ]
        ),
        ANY_TEXT,
        max_size=3,
    ),
    headers=st.dictionaries(
        st.sampled_from(["last-event-id", "range", "idempotency-key", "content-type"]),
        st.one_of(ANY_TEXT, st.sampled_from(DIGITS).map(lambda d: f"bytes={d}-{d}")).map(_header_value),
        max_size=3,
    ),
    body=BODIES,
)
async def test_any_request_to_any_route_is_answered_below_500(
    stack: HttpStack, signed_in: tuple[httpx.AsyncClient, str], route: tuple[str, str], task_id: str,
    query: dict[str, str], headers: dict[str, bytes], body: bytes | None,
) -> None:
    method, template = route
    if task_id == "real":
        async with httpx.AsyncClient(base_url=stack.url, headers=stack.headers(), timeout=30) as api:
            task_id = (await api.post("/v1/tasks", json={"prompt": "a fox"})).json()["task"]["id"]
    path = template.replace("{id}", quote(task_id, safe=""))
    web, csrf = signed_in
    sent: dict[str, Any] = {**headers}
    if path.startswith("/dashboard"):
        sent |= {"x-csrf-token": csrf, "content-type": "application/json"}
    else:
        sent["authorization"] = stack.headers()["authorization"]
    async with web.stream(method, path, params=query, headers=sent, content=body) as got:
        assert got.status_code < 500, (method, path, query, headers, body[:200] if body else body, got.status_code)
