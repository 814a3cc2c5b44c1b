"""The HTTP/JSON API over the real services: every route, the error mapping, SSE with Last-Event-ID and across a
notifier restart, and the OpenAPI document checked against the real responses."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io
import json
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import grpc
import httpx
import jsonschema
import pytest
from PIL import Image

from services.http import openapi
from services.http import upstream as http_upstream
from services.notifier import service as notifier_service
from taskgate import auth, output, store
from taskgate.config import ModelSpec, Settings
from taskgate.results import result_store
from taskgate.runtime import Backends
from taskgate.sealing import Sealer
from taskgate.states import Status
from tests.support import harness
from tests.support.factories import claimed
from tests.support.harness import HttpStack, wait_for

SMALL = {"num_frames": 9, "width": 32, "height": 32, "num_inference_steps": 2}


@pytest.fixture
def settings(settings: Settings) -> Settings:
    models = {
        **settings.models,
        "sleepy": ModelSpec(kind="sleep", sleep_seconds=0.3),
        "held": ModelSpec(kind="sleep"),  # nobody serves it: its tasks wait QUEUED
        "sleepy-i2v": ModelSpec(kind="sleep", task_types=["image-to-video"]),
    }
    return settings.model_copy(update={
        "models": models, "default_model": "sleepy", "progress_interval_seconds": 0.05, "stream_keepalive_seconds": 0.5,
        "submits_per_minute": 10_000,
    })


@pytest.fixture
async def stack(settings: Settings, backends: Backends) -> AsyncIterator[HttpStack]:
    async with harness.http_stack(settings, backends, worker_models=["sleepy", "sleepy-i2v"]) as s:
        yield s


@pytest.fixture
async def client(stack: HttpStack) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=stack.url, headers=stack.headers(), timeout=20) as c:
        yield c


DOC = openapi.document()


def conforms(body: Any, component: str) -> None:
    """The body is valid against the OpenAPI document's schema of `component`."""
    schema = {"$ref": f"#/components/schemas/{component}", "components": DOC["components"]}
    jsonschema.validate(body, schema, cls=jsonschema.Draft202012Validator)


def error_of(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    conforms(body, "Error")
    assert body["error"]["code"] == status and body["error"]["status"] == code
    return dict(body["error"])


def violations(error: dict[str, Any]) -> set[str]:
    return {v["field"] for d in error["details"] for v in d.get("field_violations", [])}


async def finished(client: httpx.AsyncClient, task_id: str) -> dict[str, Any]:
    async def done() -> bool:
        task = (await client.get(f"/v1/tasks/{task_id}")).json()["task"]
        return task["status"] in (
            "TASK_STATUS_SUCCEEDED",
            "TASK_STATUS_FAILED",
            "TASK_STATUS_CANCELED",
            "TASK_STATUS_TIMEOUT",
        )

    await wait_for(done, within=20)
    body: dict[str, Any] = (await client.get(f"/v1/tasks/{task_id}")).json()
    return body


# ---------------------------------------------------------------- the gateway routes


async def test_submit_get_list_with_the_idempotency_key_header(client: httpx.AsyncClient) -> None:
    created = await client.post(
        "/v1/tasks", json={"prompt": "a fox", "params": SMALL}, headers={"Idempotency-Key": "order-1"}
    )
    assert created.status_code == 201, created.text
    body = created.json()
    conforms(body, "SubmitTaskResponse")
    task = body["task"]
    assert (
        body["created"] is True
        and task["idempotency_key"] == "order-1"
        and created.headers["location"] == f"/v1/tasks/{task['id']}"
    )
    again = await client.post(
        "/v1/tasks", json={"prompt": "a fox", "params": SMALL}, headers={"Idempotency-Key": "order-1"}
    )
    assert again.status_code == 200 and again.json()["task"]["id"] == task["id"] and again.json()["created"] is False
    clash = await client.post(
        "/v1/tasks", json={"prompt": "another", "params": SMALL}, headers={"Idempotency-Key": "order-1"}
    )
    assert "IDEMPOTENCY_KEY_REUSED" in json.dumps(error_of(clash, 409, "ALREADY_EXISTS")["details"])
    got = await client.get(f"/v1/tasks/{task['id']}")
    assert got.status_code == 200 and float(got.headers["x-suggested-poll-interval"]) == 2
    conforms(got.json(), "GetTaskResponse")
    done = await finished(client, task["id"])
    assert done["task"]["status"] == "TASK_STATUS_SUCCEEDED" and done["task"]["result"]["sha256"]
    listed = await client.get("/v1/tasks", params={"status": "succeeded", "page_size": 1})
    conforms(listed.json(), "ListTasksResponse")
    assert [t["id"] for t in listed.json()["tasks"]] == [task["id"]]
    assert (await client.get("/v1/tasks", params={"status": "QUEUED"})).json()["tasks"] == []


async def test_batch_answers_each_item(client: httpx.AsyncClient) -> None:
    answer = await client.post("/v1/tasks:batch", json={"requests": [
        {"prompt": "one", "params": SMALL}, {"prompt": " ", "params": SMALL}, {"prompt": "three", "model_id": "nope"},
    ]})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    conforms(body, "SubmitTasksResponse")
    first, second, third = body["results"]
    assert first["response"]["created"] is True and first["response"]["task"]["prompt"] == "one"
    assert second["error"]["status"] == "INVALID_ARGUMENT" and violations(second["error"]) == {"prompt"}
    assert violations(third["error"]) == {"model_id"}


async def test_errors_are_http_statuses_with_the_google_rpc_details(
    client: httpx.AsyncClient, stack: HttpStack
) -> None:
    bad = await client.post("/v1/tasks", json={"prompt": "", "params": {"num_frames": 8}})
    assert violations(error_of(bad, 400, "INVALID_ARGUMENT")) == {"prompt", "params.num_frames"}
    assert violations(error_of(await client.post("/v1/tasks", content=b"{not json"), 400, "INVALID_ARGUMENT")) == {
        "body"
    }
    assert violations(error_of(await client.post("/v1/tasks", json={"promt": "typo"}), 400, "INVALID_ARGUMENT")) == {
        "body"
    }
    assert violations(error_of(await client.post("/v1/tasks", json=[1, 2]), 400, "INVALID_ARGUMENT")) == {"body"}
    error_of(await client.get("/v1/tasks/123456789"), 404, "NOT_FOUND")
    assert violations(error_of(await client.get("/v1/tasks/fox"), 400, "INVALID_ARGUMENT")) == {"task_id"}
    assert violations(error_of(await client.get("/v1/tasks", params={"status": "DONE"}), 400, "INVALID_ARGUMENT")) == {
        "status"
    }
    assert violations(
        error_of(await client.get("/v1/tasks", params={"created_after": "yesterday"}), 400, "INVALID_ARGUMENT")
    ) == {"created_after"}
    anonymous = await client.get("/v1/tasks", headers={"authorization": ""})
    error_of(anonymous, 401, "UNAUTHENTICATED")
    error_of(await client.get("/v1/tasks", headers={"authorization": "Bearer tg_nope"}), 401, "UNAUTHENTICATED")
    # a pending-limit refusal: 429 with Retry-After... the rate limit says when
    slow = await harness_key(stack, "tenant-slow", submits_per_minute=1)
    first = await client.post(
        "/v1/tasks", json={"prompt": "x", "params": SMALL}, headers={"authorization": f"Bearer {slow}"}
    )
    assert first.status_code == 201
    limited = await client.post(
        "/v1/tasks", json={"prompt": "y", "params": SMALL}, headers={"authorization": f"Bearer {slow}"}
    )
    error = error_of(limited, 429, "RESOURCE_EXHAUSTED")
    assert int(limited.headers["retry-after"]) >= 1 and "RATE_LIMITED" in json.dumps(error["details"])


async def harness_key(stack: HttpStack, tenant: str, **limits: Any) -> str:
    from taskgate import auth

    key, _ = await auth.create_key(stack.submit.backends.pool, stack.settings.api_key_pepper, tenant, **limits)
    return key


async def test_cancel_and_regenerate(client: httpx.AsyncClient) -> None:
    held = (await client.post("/v1/tasks", json={"prompt": "wait", "model_id": "held", "params": SMALL})).json()["task"]
    canceled = await client.post(f"/v1/tasks/{held['id']}:cancel", json={"hard": True})
    assert canceled.status_code == 200 and canceled.json()["task"]["status"] == "TASK_STATUS_CANCELED"
    conforms(canceled.json(), "CancelTaskResponse")
    again = await client.post(
        f"/v1/tasks/{held['id']}:regenerate", json={"seed": 5}, headers={"Idempotency-Key": "regen-1"}
    )
    assert again.status_code == 201, again.text
    conforms(again.json(), "RegenerateTaskResponse")
    assert again.json()["source_task_id"] == held["id"] and again.json()["task"]["params"]["seed"] == "5"
    repeat = await client.post(
        f"/v1/tasks/{held['id']}:regenerate", json={"seed": 5}, headers={"Idempotency-Key": "regen-1"}
    )
    assert repeat.status_code == 200 and repeat.json()["task"]["id"] == again.json()["task"]["id"]
    running = (await client.post("/v1/tasks", json={"prompt": "not yet", "model_id": "held", "params": SMALL})).json()[
        "task"
    ]
    early = await client.post(f"/v1/tasks/{running['id']}:regenerate")
    assert "TASK_NOT_FINISHED" in json.dumps(error_of(early, 400, "FAILED_PRECONDITION")["details"])


async def test_a_tenant_rotates_its_own_webhook_secret(
    client: httpx.AsyncClient, stack: HttpStack, backends: Backends
) -> None:
    key, old = await auth.create_key(backends.pool, stack.settings.api_key_pepper, "tenant-rotating")
    mine = {"authorization": f"Bearer {key}"}
    sealer = Sealer.of(stack.settings)
    others = await auth.webhook_secrets(backends.pool, "tenant-a", sealer)

    rotated = await client.post("/v1/webhook-secret:rotate", json={"overlap": "3600s"}, headers=mine)
    assert rotated.status_code == 200 and rotated.headers["cache-control"] == "no-store", rotated.text
    conforms(rotated.json(), "TaskGatewayRotateWebhookSecretResponse")
    new = rotated.json()["webhook_secret"]
    assert new.startswith("whsec_") and new != old and rotated.json()["valid_secrets"] == 2
    until = datetime.fromisoformat(rotated.json()["previous_valid_until"].replace("Z", "+00:00"))
    assert timedelta(minutes=59) < until - datetime.now(UTC) <= timedelta(hours=1)
    assert set(await auth.webhook_secrets(backends.pool, "tenant-rotating", sealer)) == {old, new}

    # no body: the default overlap; "0s" retires every current secret at once, the newest alone signs
    assert (await client.post("/v1/webhook-secret:rotate", headers=mine)).json()["valid_secrets"] == 3
    last = await client.post("/v1/webhook-secret:rotate", json={"overlap": "0s"}, headers=mine)
    assert last.json()["valid_secrets"] == 1
    assert await auth.webhook_secrets(backends.pool, "tenant-rotating", sealer) == [last.json()["webhook_secret"]]
    assert await auth.webhook_secrets(backends.pool, "tenant-a", sealer) == others  # only the caller's own tenant

    negative = await client.post("/v1/webhook-secret:rotate", json={"overlap": "-1s"}, headers=mine)
    assert violations(error_of(negative, 400, "INVALID_ARGUMENT")) == {"overlap"}
    not_an_object = await client.post("/v1/webhook-secret:rotate", json=[1], headers=mine)
    assert violations(error_of(not_an_object, 400, "INVALID_ARGUMENT")) == {"body"}
    error_of(await client.post("/v1/webhook-secret:rotate", headers={"authorization": ""}), 401, "UNAUTHENTICATED")
    assert await auth.webhook_secrets(backends.pool, "tenant-rotating", sealer) == [last.json()["webhook_secret"]]


async def test_the_result_with_its_digest_and_ranges(client: httpx.AsyncClient) -> None:
    task = (await client.post("/v1/tasks", json={"prompt": "download me", "params": SMALL})).json()["task"]
    done = (await finished(client, task["id"]))["task"]
    whole = await client.get(f"/v1/tasks/{task['id']}/result")
    assert whole.status_code == 200 and whole.headers["content-type"] == done["result"]["content_type"]
    data = whole.content
    assert int(whole.headers["content-length"]) == len(data) == int(done["result"]["size_bytes"])
    assert hashlib.sha256(data).hexdigest() == done["result"]["sha256"]
    assert whole.headers["digest"] == "sha-256=" + base64.b64encode(hashlib.sha256(data).digest()).decode()
    part = await client.get(f"/v1/tasks/{task['id']}/result", headers={"range": "bytes=10-19"})
    assert part.status_code == 206 and part.content == data[10:20]
    assert part.headers["content-range"] == f"bytes 10-19/{len(data)}"
    tail = await client.get(f"/v1/tasks/{task['id']}/result", headers={"range": "bytes=-7"})
    assert tail.status_code == 206 and tail.content == data[-7:]
    outside = await client.get(f"/v1/tasks/{task['id']}/result", headers={"range": f"bytes={len(data) + 5}-"})
    assert outside.status_code == 416 and outside.headers["content-range"] == f"bytes */{len(data)}"
    held = (await client.post("/v1/tasks", json={"prompt": "not done", "model_id": "held", "params": SMALL})).json()[
        "task"
    ]
    error_of(await client.get(f"/v1/tasks/{held['id']}/result"), 400, "FAILED_PRECONDITION")


async def test_an_image_is_uploaded_with_put_and_named_in_a_submission(client: httpx.AsyncClient) -> None:
    out = io.BytesIO()
    Image.new("RGB", (40, 30), (1, 2, 3)).save(out, format="PNG")
    uploaded = await client.put("/v1/inputs", content=out.getvalue(), headers={"content-type": "image/png"})
    assert uploaded.status_code == 201, uploaded.text
    conforms(uploaded.json(), "UploadInputResponse")
    image = uploaded.json()["image"]
    assert (image["width"], image["height"], image["source_format"]) == (40, 30, "PNG")
    task = await client.post(
        "/v1/tasks",
        json={
            "prompt": "it moves",
            "task_type": "image-to-video",
            "model_id": "sleepy-i2v",
            "image": {"upload_sha256": image["sha256"]},
        },
    )
    assert task.status_code == 201 and task.json()["task"]["image"]["sha256"] == image["sha256"]
    inline = await client.post("/v1/tasks", json={
        "prompt": "it moves", "task_type": "image-to-video", "model_id": "sleepy-i2v",
        "image": {"data": base64.b64encode(out.getvalue()).decode()},
    })
    assert inline.status_code == 200 and inline.json()["task"]["id"] == task.json()["task"]["id"]  # the same request
    junk = await client.put("/v1/inputs", content=b"not an image")
    assert violations(error_of(junk, 400, "INVALID_ARGUMENT")) == {"data"}


# ---------------------------------------------------------------- Server-Sent Events


async def sse(
    client: httpx.AsyncClient, path: str, *, headers: dict[str, str] | None = None,
    until: Callable[[list[dict[str, Any]]], bool] | None = None, ready: asyncio.Event | None = None,
) -> list[dict[str, Any]]:
    """The events of an SSE response (id, event, data parsed) until it ends or `until(events)` holds."""
    events: list[dict[str, Any]] = []
    async with client.stream("GET", path, headers=headers or {}) as response:
        assert response.status_code == 200, await response.aread()
        assert response.headers["content-type"].startswith("text/event-stream")
        current: dict[str, Any] = {}
        async for line in response.aiter_lines():
            if line.startswith(":"):
                current.setdefault("comments", 0)
                continue
            if not line:
                if "data" in current:
                    current["data"] = json.loads(current["data"])
                    events.append(current)
                    if ready is not None:
                        ready.set()
                    if until is not None and until(events):
                        return events
                current = {}
                continue
            name, _, value = line.partition(":")
            current[name] = value.removeprefix(" ")
    return events


async def test_task_events_stream_each_version_and_resume_with_last_event_id(client: httpx.AsyncClient) -> None:
    task = (await client.post("/v1/tasks", json={"prompt": "follow me", "params": SMALL})).json()["task"]
    events = await sse(client, f"/v1/tasks/{task['id']}/events")
    versions = [int(e["id"]) for e in events]
    assert events[0]["event"] == "snapshot" and all(e["event"] == "transition" for e in events[1:])
    assert versions == sorted(set(versions)) and events[-1]["data"]["to_status"] == "TASK_STATUS_SUCCEEDED"
    conforms(events[0]["data"], "Snapshot")
    for e in events[1:]:
        conforms(e["data"], "TaskEvent")
    # resume after the second: exactly the rest, no snapshot
    rest = await sse(client, f"/v1/tasks/{task['id']}/events", headers={"last-event-id": events[1]["id"]})
    assert [int(e["id"]) for e in rest] == versions[2:]
    error_of(await client.get("/v1/tasks/123456789/events"), 404, "NOT_FOUND")
    bad = await client.get(f"/v1/tasks/{task['id']}/events", headers={"last-event-id": "x"})
    assert violations(error_of(bad, 400, "INVALID_ARGUMENT")) == {"Last-Event-ID"}


async def test_all_events_resume_from_the_cursor_and_keep_alive(client: httpx.AsyncClient) -> None:
    first = (await client.post("/v1/tasks", json={"prompt": "one", "params": SMALL})).json()["task"]
    await finished(client, first["id"])
    everything = await sse(client, "/v1/events?cursor=0&status=SUCCEEDED", until=lambda e: len(e) >= 1)
    assert (
        everything[0]["data"]["task_id"] == first["id"]
        and everything[0]["data"]["to_status"] == "TASK_STATUS_SUCCEEDED"
    )
    cursor = everything[0]["id"]
    second = (await client.post("/v1/tasks", json={"prompt": "two", "params": SMALL})).json()["task"]
    await finished(client, second["id"])

    def reached_second(events: list[dict[str, Any]]) -> bool:
        return any(e["data"]["task_id"] == second["id"] for e in events)

    later = await sse(client, "/v1/events?status=SUCCEEDED", headers={"last-event-id": cursor}, until=reached_second)
    # from the cursor on: the second task's event; the first's may come again (a resumed WatchTasks looks back a
    # little, ids commit out of order: clients skip by task id and version), never an event before it
    assert {e["data"]["task_id"] for e in later} <= {first["id"], second["id"]} and reached_second(later)


async def test_a_task_stream_rides_out_a_notifier_restart(settings: Settings, backends: Backends) -> None:
    """The notifier goes away mid-stream and comes back on the same port: the SSE client sees every version once."""
    async with (
        harness.http_stack(settings, backends, worker_models=None) as stack,
        httpx.AsyncClient(base_url=stack.url, headers=stack.headers(), timeout=30) as client,
    ):
        task = (await client.post("/v1/tasks", json={"prompt": "long", "model_id": "held", "params": SMALL})).json()[
            "task"
        ]
        tid = int(task["id"])
        await wait_for(lambda: _status_is(backends, tid, Status.QUEUED))
        ready = asyncio.Event()
        reading = asyncio.create_task(sse(client, f"/v1/tasks/{tid}/events", ready=ready))
        await asyncio.wait_for(ready.wait(), 10)  # the snapshot arrived
        port = stack.notifier.port
        await stack.notifier.stop()
        await claimed(backends.pool, tid, worker_id="w")
        stack.notifier = await notifier_service.start(stack.settings.model_copy(update={"notifier_port": port}))
        await store.progress(backends.pool, tid, attempt=1, percent=50, lease_seconds=30, actor="worker")
        stored = await result_store(settings, backends.bus).put(f"{tid}-a1.json", b"{}", "application/json")
        ref = store.ResultRef(stored.uri, stored.content_type, stored.size, stored.sha256)
        await store.succeed(backends.pool, tid, attempt=1, result=ref, actor="worker")
        events = await asyncio.wait_for(reading, 30)
    versions = [int(e["id"]) for e in events]
    assert versions == list(range(versions[0], versions[0] + len(versions)))  # every version, once, in order
    assert events[-1]["data"]["to_status"] == "TASK_STATUS_SUCCEEDED"


async def _status_is(backends: Backends, task_id: int, status: Status) -> bool:
    row = await store.get_task(backends.pool, task_id)
    return row is not None and row.status is status


# ---------------------------------------------------------------- the document


async def test_the_openapi_document_is_served_and_names_every_route(
    client: httpx.AsyncClient, stack: HttpStack
) -> None:
    served = await client.get("/openapi.json")
    assert served.status_code == 200 and served.json() == json.loads(json.dumps(DOC))
    assert served.json()["openapi"].startswith("3.1")
    jsonschema.Draft202012Validator.check_schema({"components": DOC["components"]})
    routes = {getattr(r, "path", "") for r in stack.http.app.routes}
    documented = set(DOC["paths"])
    served_api = {r for r in routes if r.startswith(("/v1/", "/openai/v1/"))} - {"/openai/v1/{rest:path}"}
    assert served_api == documented


# ---------------------------------------------------------------- the mapping


@pytest.mark.parametrize(
    ("code", "status"), sorted((c.name, s) for c, s in http_upstream.HTTP_STATUS.items() if c.name != "OK")
)
def test_every_grpc_status_has_its_http_status_and_a_conforming_body(code: str, status: int) -> None:
    response = http_upstream.error_response(grpc.StatusCode[code], "why")
    body = json.loads(bytes(response.body))
    conforms(body, "Error")
    assert response.status_code == status and body["error"] == {
        "code": status,
        "status": code,
        "message": "why",
        "details": [],
    }
    assert ("retry-after" in response.headers) == (status == 503)  # 429 carries it when the server's RetryInfo says


async def test_a_gateway_that_is_down_is_503_with_retry_after(client: httpx.AsyncClient, stack: HttpStack) -> None:
    await stack.submit.stop(0)
    answer = await client.get("/v1/tasks/123")
    error_of(answer, 503, "UNAVAILABLE")
    assert int(answer.headers["retry-after"]) >= 1


async def test_a_body_past_its_cap_is_refused_naming_the_body(client: httpx.AsyncClient, stack: HttpStack) -> None:
    cap = 2 * stack.settings.grpc_max_message_bytes
    answer = await client.post("/v1/tasks", content=b"{" + b" " * cap + b"}")
    assert violations(error_of(answer, 400, "INVALID_ARGUMENT")) == {"body"}


async def test_readiness_follows_the_gateway_and_the_events_while_liveness_stays(
    stack: HttpStack, client: httpx.AsyncClient
) -> None:
    """/readyz asks the upstreams' own readiness: a face whose events service is gone is taken out of a load
    balancer's rotation (503 naming it), and back when it returns; /healthz (liveness) stays 200 meanwhile."""
    ready = await client.get("/readyz")
    assert ready.status_code == 200, ready.text
    assert ready.json() == {"status": "SERVING", "upstreams": {"gateway": "SERVING", "events": "SERVING"}}
    port = stack.notifier.port
    await stack.notifier.stop()

    async def unready() -> bool:
        got = await client.get("/readyz")
        return got.status_code == 503 and got.json()["upstreams"]["events"] != "SERVING"

    await wait_for(unready, within=15)
    assert (await client.get("/readyz")).json()["upstreams"]["gateway"] == "SERVING"
    assert (await client.get("/healthz")).status_code == 200
    stack.notifier = await notifier_service.start(stack.settings.model_copy(update={"notifier_port": port}))

    async def ready_again() -> bool:
        return (await client.get("/readyz")).status_code == 200

    await wait_for(ready_again, within=30)


async def test_task_events_carry_the_output_and_one_last_event_id_resumes_both(
    client: httpx.AsyncClient, backends: Backends
) -> None:
    """Output chunks arrive as `output` events with ids `<version>.<sequence>`; a client that drops mid-way and
    reconnects with its Last-Event-ID gets every chunk and event it missed, none twice."""
    task = (await client.post("/v1/tasks", json={"prompt": "talk", "model_id": "held", "params": SMALL})).json()["task"]
    tid = int(task["id"])
    await wait_for(lambda: _status_is(backends, tid, Status.QUEUED))
    await claimed(backends.pool, tid, worker_id="w")
    words = [f"word{i} " for i in range(12)]
    offset = 0
    for word in words[:5]:
        await output.publish(backends.bus, "tenant-a", output.Chunk(tid, 1, output.TEXT, text=word, offset=offset))
        offset += len(word)
    first = await sse(client, f"/v1/tasks/{tid}/events", until=lambda e: sum(x["event"] == "output" for x in e) == 5)
    assert first[0]["event"] == "snapshot" and first[0]["id"] == "3"
    outputs = [e for e in first if e["event"] == "output"]
    for e in outputs:
        conforms(e["data"], "OutputChunk")
        version, sequence = e["id"].split(".")
        assert version == "3" and sequence == e["data"]["sequence"]
    for word in words[5:]:  # while the client is away
        await output.publish(backends.bus, "tenant-a", output.Chunk(tid, 1, output.TEXT, text=word, offset=offset))
        offset += len(word)
    await store.progress(backends.pool, tid, attempt=1, percent=50, lease_seconds=30, actor="worker")
    rest = await sse(
        client,
        f"/v1/tasks/{tid}/events",
        headers={"last-event-id": first[-1]["id"]},
        until=lambda e: sum(x["event"] == "output" for x in e) == 7 and any(x["event"] == "transition" for x in e),
    )
    assert "snapshot" not in {e["event"] for e in rest}
    text = "".join(e["data"]["text"] for e in first + rest if e["event"] == "output")
    assert text == "".join(words)  # nothing missed, nothing repeated
    transition = next(e for e in rest if e["event"] == "transition")
    assert transition["data"]["progress"] == 50 and transition["id"].startswith("4.")
    # the same resume from query parameters; and a stream that opts out of the output gets none
    sequence = int(outputs[-1]["data"]["sequence"])
    again = await sse(client, f"/v1/tasks/{tid}/events?after_version=3&after_output_sequence={sequence}",
                      until=lambda e: sum(x["event"] == "output" for x in e) == 7)
    assert "".join(e["data"]["text"] for e in again if e["event"] == "output") == "".join(words[5:])
    plain = await sse(client, f"/v1/tasks/{tid}/events?output=false", until=lambda e: len(e) >= 1)
    assert plain[0]["event"] == "snapshot" and plain[0]["id"] == "4"


@pytest.mark.parametrize("bad", ["x", "3.", ".5", "3.x", "3.5.1", "3.²", "²", "3. 5", "-1", "3.-5", "9" * 20])
async def test_a_task_stream_refuses_a_last_event_id_it_never_sent(client: httpx.AsyncClient, bad: str) -> None:
    task = (await client.post("/v1/tasks", json={"prompt": "ids", "model_id": "held", "params": SMALL})).json()["task"]
    response = await client.get(f"/v1/tasks/{task['id']}/events", headers={b"last-event-id": bad.encode()})
    assert violations(error_of(response, 400, "INVALID_ARGUMENT")) == {"Last-Event-ID"}
