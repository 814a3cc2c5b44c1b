"""The S3 result store against a real S3-compatible server (SeaweedFS with a configured identity): outputs stored with
their sha256 and content type, presigned download URLs that the server really checks (a wrong signature and an
expired URL are refused), and the URL in GetTask, the watch stream's terminal event, the webhook and the SDK."""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest

from taskgate import auth
from taskgate.config import ModelSpec, Settings
from taskgate.results import ResultNotFound, S3Results
from taskgate.runtime import Backends
from taskgate_client import IntegrityError, Status, connect_async
from tests.support.harness import wait_for
from tests.support.s3server import SeaweedS3
from tests.support.webhooks import WebhookReceiver


@pytest.fixture
def s3_settings(settings: Settings, s3_server: SeaweedS3) -> Settings:
    return settings.model_copy(
        update={
            "result_store": "s3",
            "s3_endpoint_url": s3_server.endpoint,
            "s3_bucket": s3_server.bucket,
            "s3_addressing_style": "path",
            "s3_access_key_id": s3_server.access_key,
            "s3_secret_access_key": s3_server.secret_key,
            "s3_prefix": f"t-{settings.state_dir.name}/",  # each test its own keys in the session's bucket
        }
    )


async def test_outputs_are_stored_with_sha256_and_content_type_and_stream_back(
    s3_settings: Settings, s3_server: SeaweedS3
) -> None:
    store = S3Results(s3_settings)
    data = bytes(range(256)) * 4000  # several read chunks
    stored = await store.put("1-a1.mp4", data, "video/mp4")
    assert stored.uri == f"s3://{s3_server.bucket}/{s3_settings.s3_prefix}1-a1.mp4"
    assert (stored.size, stored.sha256) == (len(data), hashlib.sha256(data).hexdigest())
    head = s3_server.client().head_object(Bucket=s3_server.bucket, Key=f"{s3_settings.s3_prefix}1-a1.mp4")
    assert head["ContentType"] == "video/mp4" and head["Metadata"] == {"sha256": stored.sha256}
    assert b"".join([c async for c in store.read(stored.uri)]) == data
    await store.delete(stored.uri)
    await store.delete(stored.uri)  # idempotent
    with pytest.raises(ResultNotFound):
        [c async for c in store.read(stored.uri)]
    assert store.link("nats-os://taskgate-results/x") is None  # an output of another store has no URL


async def test_a_presigned_url_downloads_and_a_wrong_signature_or_no_signature_is_refused(
    s3_settings: Settings, s3_server: SeaweedS3
) -> None:
    store = S3Results(s3_settings)
    stored = await store.put("2-a1.mp4", b"video bytes", "video/mp4")
    link = store.link(stored.uri)
    assert link is not None
    assert abs((link.expires_at - datetime.now(UTC)).total_seconds() - s3_settings.result_url_ttl_seconds) < 60
    async with httpx.AsyncClient() as http:
        ok = await http.get(link.url)
        assert ok.status_code == 200 and ok.content == b"video bytes"
        assert ok.headers["content-type"] == "video/mp4" and ok.headers["x-amz-meta-sha256"] == stored.sha256
        forged = S3Results(s3_settings.model_copy(update={"s3_secret_access_key": "not-the-secret-key-0000"}))
        bad = forged.link(stored.uri)
        assert bad is not None
        refused = await http.get(bad.url)
        assert refused.status_code == 403 and "SignatureDoesNotMatch" in refused.text
        bare = await http.get(link.url.split("?")[0])
        assert bare.status_code == 403


async def test_an_expired_url_is_refused(
    s3_settings: Settings, s3_server: SeaweedS3, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = S3Results(s3_settings)
    stored = await store.put("3-a1.mp4", b"old bytes", "video/mp4")
    # signed two TTLs ago: the signing clock is botocore's, injected here; the server judges the expiry itself
    signed_at = datetime.now(UTC).replace(tzinfo=None) - timedelta(seconds=2 * s3_settings.result_url_ttl_seconds)
    monkeypatch.setattr("botocore.auth.get_current_datetime", lambda: signed_at)
    link = store.link(stored.uri)
    monkeypatch.undo()
    assert link is not None
    async with httpx.AsyncClient() as http:
        expired = await http.get(link.url)
        assert expired.status_code == 403 and "expired" in expired.text.lower()
        fresh = store.link(stored.uri)
        assert fresh is not None and (await http.get(fresh.url)).status_code == 200


async def test_get_task_watch_webhook_and_sdk_download_carry_a_working_result_url(
    s3_settings: Settings, backends: Backends, s3_server: SeaweedS3, tmp_path: Path
) -> None:
    from services.notifier import service as notifier_service
    from services.submit import service as submit_service
    from services.worker import service as worker_service

    settings = s3_settings.model_copy(
        update={"models": {**s3_settings.models, "sleepy": ModelSpec(kind="sleep", sleep_seconds=0.05)},
                "worker_models": ["sleepy"]}
    )
    api_key, _secret = await auth.create_key(backends.pool, settings.api_key_pepper, "s3-tenant")
    submit = await submit_service.start(settings, backends)
    notifier = await notifier_service.start(settings)
    worker = await worker_service.start(settings)
    try:
        async with WebhookReceiver() as hook, connect_async(
            f"127.0.0.1:{submit.port}", api_key, events_address=f"127.0.0.1:{notifier.port}"
        ) as client, httpx.AsyncClient() as http:
            task = await client.submit("to the bucket", "sleepy", callback_url=hook.url())
            events = [e async for e in client.watch(task.task_id)]
            terminal = events[-1]
            assert terminal.status is Status.SUCCEEDED and terminal.result is not None
            assert terminal.result.url.startswith(s3_server.endpoint) and terminal.result.url_expires_at is not None

            done = await client.get(task.task_id)
            assert done.result is not None and done.result.uri.startswith(f"s3://{s3_server.bucket}/")
            assert done.result.url.startswith(s3_server.endpoint + "/")
            fetched = await http.get(done.result.url)
            assert fetched.status_code == 200
            assert hashlib.sha256(fetched.content).hexdigest() == done.result.sha256

            await wait_for(lambda: len(hook.requests) >= 1, within=20)
            data = hook.requests[0].json()["data"]
            assert data["status"] == "SUCCEEDED" and data["result"]["sha256"] == done.result.sha256
            assert data["result_url_expires_at"].endswith("Z")
            by_webhook = await http.get(data["result_url"])
            assert by_webhook.status_code == 200 and by_webhook.content == fetched.content

            saved = await client.download(task.task_id, tmp_path / "out.mp4")
            assert saved.url and (tmp_path / "out.mp4").read_bytes() == fetched.content

            # the bytes behind the URL changed: the SDK's sha256 check refuses them and leaves no file behind
            key = done.result.uri.split("/", 3)[3]
            s3_server.client().put_object(Bucket=s3_server.bucket, Key=key, Body=b"tampered", ContentType="video/mp4")
            with pytest.raises(IntegrityError):
                await client.download(task.task_id, tmp_path / "bad.mp4")
            assert not (tmp_path / "bad.mp4").exists() and not (tmp_path / "bad.mp4.part").exists()
    finally:
        await worker.stop(1.0)
        await notifier.stop()
        await submit.stop(0)
