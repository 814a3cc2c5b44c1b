"""Image-to-video inputs over real gRPC, PostgreSQL, NATS and HTTPS: inline, fetched and uploaded images, each checked
before anything is queued, stored once under its content hash, part of the request hash, covered by retention."""

from __future__ import annotations

import io
import struct
import zlib
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from PIL import Image

from services.scheduler.retention import Retention, RetentionScan
from services.scheduler.scans import Action, ScanContext
from services.submit.service import SubmitHandle
from taskgate import images, store
from taskgate.config import ModelSpec, Settings
from taskgate.results import ResultNotFound, result_store
from taskgate.runtime import Backends
from taskgate_api.v1 import gateway_pb2, gateway_pb2_grpc
from tests.support.factories import Metadata, key_for
from tests.support.harness import LocalCA, details_of, make_local_ca
from tests.support.webhooks import Received, Reply, WebhookReceiver

I2V = "image-to-video"
MODEL = "sleepy-i2v"
MAX_SIDE = 512


@pytest.fixture(scope="module")
def local_ca(tmp_path_factory: pytest.TempPathFactory) -> LocalCA:
    return make_local_ca(tmp_path_factory.mktemp("ca"))


@pytest.fixture
def settings(settings: Settings, local_ca: LocalCA) -> Settings:
    """The test settings with an image-to-video model (sleep kind) and the local CA trusted for image URLs."""
    models = {
        **settings.models,
        MODEL: ModelSpec(
            kind="sleep", task_types=[I2V], max_image_width=MAX_SIDE, max_image_height=MAX_SIDE, max_image_bytes=300_000
        ),
    }
    return settings.model_copy(
        update={
            "models": models,
            "result_store": "fs",
            "input_fetch_allow_hosts": ["localhost"],
            "input_fetch_ca_file": local_ca.ca_file,
            "input_fetch_timeout_seconds": 2.0,
            "input_max_bytes": 400_000,
            "max_pending_per_tenant": 50,
            "submits_per_minute": 1000,
        }
    )


def png(
    width: int = 48, height: int = 32, color: tuple[int, ...] = (200, 30, 60), mode: str = "RGB", **save: Any
) -> bytes:
    out = io.BytesIO()
    Image.new(mode, (width, height), color).save(out, format="PNG", **save)
    return out.getvalue()


def i2v(
    image: gateway_pb2.ImageInput | None = None, prompt: str = "the cat turns its head", **fields: Any
) -> gateway_pb2.SubmitTaskRequest:
    return gateway_pb2.SubmitTaskRequest(task_type=I2V, model_id=MODEL, prompt=prompt, image=image, **fields)


def refusal(exc: grpc.aio.AioRpcError) -> dict[str, str]:
    """An INVALID_ARGUMENT's field violations, field -> description."""
    assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, (exc.code(), exc.details())
    status = rpc_status.from_call(exc)
    assert status is not None
    return {
        v.field: v.description
        for d in details_of(status) if isinstance(d, error_details_pb2.BadRequest)
        for v in d.field_violations
    }


async def refused(stub: Any, md: Metadata, request: gateway_pb2.SubmitTaskRequest) -> dict[str, str]:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.SubmitTask(request, metadata=md, timeout=10)
    return refusal(info.value)


async def stored_inputs(backends: Backends) -> list[Any]:
    return list(await backends.pool.fetch("SELECT * FROM task_input ORDER BY created_at"))


def input_files(settings: Settings) -> list[Path]:
    folder = (settings.result_dir or settings.state_dir / "results") / "inputs"
    return sorted(folder.glob("*.png")) if folder.is_dir() else []


async def upload(stub: Any, md: Metadata, data: bytes, part: int = 7000) -> gateway_pb2.UploadInputResponse:
    async def parts() -> AsyncIterator[gateway_pb2.UploadInputRequest]:
        for offset in range(0, len(data), part):
            yield gateway_pb2.UploadInputRequest(data=data[offset : offset + part])

    answer: gateway_pb2.UploadInputResponse = await stub.UploadInput(parts(), metadata=md, timeout=10)
    return answer


# ---------------------------------------------------------------- inline images


async def test_an_inline_image_is_stored_once_in_canonical_form(
    stub: gateway_pb2_grpc.TaskGatewayAsyncStub, backends: Backends, settings: Settings
) -> None:
    md = await key_for(backends)
    sent = png(48, 32, (255, 0, 0, 0), mode="RGBA")  # fully transparent: flattened onto white
    resp = await stub.SubmitTask(i2v(gateway_pb2.ImageInput(data=sent)), metadata=md, timeout=10)
    image = resp.task.image
    assert (image.width, image.height, image.content_type) == (48, 32, "image/png")
    [row] = await stored_inputs(backends)
    assert (row["sha256"], row["width"], row["height"]) == (image.sha256, 48, 32)
    [path] = input_files(settings)
    assert path.name == f"{image.sha256}.png"
    kept = Image.open(path)
    assert kept.mode == "RGB" and kept.getpixel((0, 0)) == (255, 255, 255)
    # the task's payload says where the worker finds it, and the public task shows only what it is
    task = await backends.pool.fetchrow("SELECT request_payload FROM task WHERE id = $1", int(resp.task.id))
    assert task["request_payload"]["image"] == {
        "sha256": image.sha256, "width": 48, "height": 32, "size_bytes": path.stat().st_size, "uri": f"file://{path}"
    }


async def test_the_image_is_part_of_the_request(
    stub: gateway_pb2_grpc.TaskGatewayAsyncStub, backends: Backends
) -> None:
    md = await key_for(backends)
    red = png(color=(200, 30, 60))
    first = await stub.SubmitTask(i2v(gateway_pb2.ImageInput(data=red)), metadata=md, timeout=10)
    # the same pixels in another file (a text chunk, another compression) are the same request: same derived key
    again = await stub.SubmitTask(
        i2v(gateway_pb2.ImageInput(data=png(color=(200, 30, 60), compress_level=1))), metadata=md, timeout=10
    )
    assert first.created and not again.created and again.task.id == first.task.id
    other = await stub.SubmitTask(i2v(gateway_pb2.ImageInput(data=png(color=(20, 30, 200)))), metadata=md, timeout=10)
    assert other.created and other.task.id != first.task.id and other.task.image.sha256 != first.task.image.sha256
    # a client key reused with another image is another request
    keyed = await stub.SubmitTask(i2v(gateway_pb2.ImageInput(data=red), idempotency_key="k-1"), metadata=md, timeout=10)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.SubmitTask(
            i2v(gateway_pb2.ImageInput(data=png(color=(1, 2, 3))), idempotency_key="k-1"), metadata=md, timeout=10
        )
    assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS and keyed.created


async def test_exif_orientation_is_applied(
    stub: gateway_pb2_grpc.TaskGatewayAsyncStub, backends: Backends, settings: Settings
) -> None:
    md = await key_for(backends)
    photo = Image.new("RGB", (64, 16), (10, 200, 10))
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation: rotate 90 degrees clockwise to view
    out = io.BytesIO()
    photo.save(out, format="JPEG", exif=exif.tobytes())
    resp = await stub.SubmitTask(i2v(gateway_pb2.ImageInput(data=out.getvalue())), metadata=md, timeout=10)
    assert (resp.task.image.width, resp.task.image.height) == (16, 64)
    [path] = input_files(settings)
    assert "exif" not in Image.open(path).info  # metadata is not kept


def _png_header_only(width: int, height: int) -> bytes:
    """A valid PNG signature and IHDR claiming `width` x `height`, and no pixels: a tiny file for a huge image."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = b"IHDR" + ihdr
    return b"\x89PNG\r\n\x1a\n" + struct.pack(">I", len(ihdr)) + chunk + struct.pack(">I", zlib.crc32(chunk))


def _animated_webp() -> bytes:
    out = io.BytesIO()
    frames = [Image.new("RGB", (16, 16), c) for c in ((255, 0, 0), (0, 255, 0))]
    frames[0].save(out, format="WEBP", save_all=True, append_images=frames[1:], duration=100)
    return out.getvalue()


def _gif() -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (16, 16)).save(out, format="GIF")
    return out.getvalue()


ADVERSARIAL = {
    "zero bytes": b"",
    "truncated": png(64, 64, (1, 2, 3))[:-30],
    "wrong magic": b"\x89PNX" + png()[4:],
    "text": b"<html><body>not an image</body></html>",
    "gif (not allowed)": _gif(),
    "huge sides in a tiny file": _png_header_only(100_000, 100_000),
    "animated": _animated_webp(),
    "too many bytes": png(500, 500, (0, 0, 0), compress_level=0),
}


@pytest.mark.parametrize("case", sorted(ADVERSARIAL))
async def test_a_bad_image_is_refused_naming_the_field_and_nothing_is_stored(
    case: str, stub: gateway_pb2_grpc.TaskGatewayAsyncStub, backends: Backends, settings: Settings
) -> None:
    md = await key_for(backends)
    violations = await refused(stub, md, i2v(gateway_pb2.ImageInput(data=ADVERSARIAL[case])))
    assert list(violations) == ["image.data"], violations
    assert await stored_inputs(backends) == [] and input_files(settings) == []
    assert await backends.pool.fetchval("SELECT count(*) FROM task") == 0


async def test_a_polyglot_is_stored_as_its_pixels_alone(
    stub: gateway_pb2_grpc.TaskGatewayAsyncStub, backends: Backends, settings: Settings
) -> None:
    md = await key_for(backends)
    archive = b"PK\x03\x04" + b"<script>alert(1)</script>" * 20  # a PNG that is also something else after its end
    resp = await stub.SubmitTask(i2v(gateway_pb2.ImageInput(data=png() + archive)), metadata=md, timeout=10)
    [path] = input_files(settings)
    assert b"<script>" not in path.read_bytes() and path.read_bytes() == images.canonical(png(), images.Limits()).png
    assert resp.task.image.sha256 == images.canonical(png(), images.Limits()).sha256


async def test_the_task_type_decides_whether_an_image_belongs(
    stub: gateway_pb2_grpc.TaskGatewayAsyncStub, backends: Backends
) -> None:
    md = await key_for(backends)
    assert list(await refused(stub, md, i2v(None))) == ["image"]
    text = gateway_pb2.SubmitTaskRequest(prompt="a fox", model_id="sleepy", image=gateway_pb2.ImageInput(data=png()))
    assert "takes no image" in (await refused(stub, md, text))["image"]
    # an image-to-video request to a text-only model names the task type
    wrong = gateway_pb2.SubmitTaskRequest(
        task_type=I2V, prompt="a fox", model_id="sleepy", image=gateway_pb2.ImageInput(data=png())
    )
    assert "task_type" in await refused(stub, md, wrong)
    # no source at all
    assert list(await refused(stub, md, i2v(gateway_pb2.ImageInput()))) == ["image"]


async def test_an_image_over_the_models_sides_is_refused(
    stub: gateway_pb2_grpc.TaskGatewayAsyncStub, backends: Backends
) -> None:
    md = await key_for(backends)
    violations = await refused(stub, md, i2v(gateway_pb2.ImageInput(data=png(MAX_SIDE + 1, 8))))
    assert f"at most {MAX_SIDE}x{MAX_SIDE}" in violations["image.data"]


# ---------------------------------------------------------------- uploads


async def test_an_upload_is_named_by_its_sha256_and_only_its_tenant_may_use_it(
    stub: gateway_pb2_grpc.TaskGatewayAsyncStub, backends: Backends, settings: Settings
) -> None:
    md = await key_for(backends)
    data = png(300, 200, (5, 6, 7), compress_level=0)  # about 180 KB: sent in 26 parts
    answer = await upload(stub, md, data)
    image = answer.image
    assert (image.width, image.height, image.source_format) == (300, 200, "PNG")
    assert image.sha256 == images.canonical(data, images.Limits()).sha256
    resp = await stub.SubmitTask(i2v(gateway_pb2.ImageInput(upload_sha256=image.sha256)), metadata=md, timeout=10)
    assert resp.task.image.sha256 == image.sha256
    # the same pixels inline are the same request as the upload
    inline = await stub.SubmitTask(i2v(gateway_pb2.ImageInput(data=data)), metadata=md, timeout=10)
    assert not inline.created and inline.task.id == resp.task.id
    assert len(input_files(settings)) == 1
    other = await key_for(backends, "tenant-b")
    violations = await refused(stub, other, i2v(gateway_pb2.ImageInput(upload_sha256=image.sha256)))
    assert "names no input image of this tenant" in violations["image.upload_sha256"]
    assert (
        "hex digits"
        in (await refused(stub, md, i2v(gateway_pb2.ImageInput(upload_sha256="abc"))))["image.upload_sha256"]
    )


async def test_an_upload_over_the_limit_or_not_an_image_is_refused(
    stub: gateway_pb2_grpc.TaskGatewayAsyncStub, backends: Backends, settings: Settings
) -> None:
    md = await key_for(backends)
    for data, words in (
        (b"\x00" * (settings.input_max_bytes + 1), "larger than"),
        (b"GIF89a" + b"\x00" * 100, "not an image"),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await upload(stub, md, data, part=64 * 1024)
        assert words in refusal(info.value)["data"]
    assert await stored_inputs(backends) == [] and input_files(settings) == []


async def test_an_upload_counts_against_the_tenants_submission_rate(
    stub: gateway_pb2_grpc.TaskGatewayAsyncStub, backends: Backends
) -> None:
    md = await key_for(backends, "tenant-slow", submits_per_minute=2)
    for tint in (1, 2):
        await upload(stub, md, png(color=(tint, 0, 0)))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await upload(stub, md, png(color=(3, 0, 0)))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert len(await stored_inputs(backends)) == 2


# ---------------------------------------------------------------- URLs


@pytest.fixture
async def image_host(local_ca: LocalCA) -> AsyncIterator[WebhookReceiver]:
    """An HTTPS server as `localhost`, certified by the local CA, serving test images by path."""
    replies = {
        "/cat.png": Reply(200, {"content-type": "image/png"}, png(40, 24, (9, 9, 9))),
        "/page": Reply(200, {"content-type": "text/html"}, b"<html></html>"),
        "/moved": Reply(302, {"location": "https://localhost/cat.png"}, b""),
        "/missing": Reply(404, {}, b"no"),
        "/big": Reply(200, {"content-type": "image/png"}, body_bytes=500_000),
        "/hang": Reply(None),
    }

    def answer(request: Received) -> Reply:
        return replies.get(request.path, Reply(404, {}, b""))

    async with WebhookReceiver(answer, tls=local_ca.server_context()) as host:
        yield host


async def test_an_image_url_is_fetched_over_verified_https(
    stub: gateway_pb2_grpc.TaskGatewayAsyncStub, backends: Backends, image_host: WebhookReceiver
) -> None:
    md = await key_for(backends)
    resp = await stub.SubmitTask(i2v(gateway_pb2.ImageInput(url=image_host.url("/cat.png"))), metadata=md, timeout=10)
    assert (resp.task.image.width, resp.task.image.height) == (40, 24)
    assert resp.task.image.sha256 == images.canonical(png(40, 24, (9, 9, 9)), images.Limits()).sha256
    [fetched] = image_host.requests
    assert fetched.headers["host"] == f"localhost:{image_host.port}"


@pytest.mark.parametrize(
    ("path", "words"),
    [
        ("/page", "content type text/html"),
        ("/moved", "redirects are not followed"),
        ("/missing", "HTTP 404"),
        ("/big", "at most 300000 are allowed"),
        ("/hang", "within 2 s"),
    ],
)
async def test_an_unusable_image_url_is_refused(
    path: str, words: str, stub: gateway_pb2_grpc.TaskGatewayAsyncStub, backends: Backends, image_host: WebhookReceiver
) -> None:
    md = await key_for(backends)
    violations = await refused(stub, md, i2v(gateway_pb2.ImageInput(url=image_host.url(path))))
    assert words in violations["image.url"], violations
    assert await stored_inputs(backends) == []


async def test_image_urls_pass_the_ssrf_guard_and_tls_is_verified(
    stub: gateway_pb2_grpc.TaskGatewayAsyncStub, backends: Backends, image_host: WebhookReceiver
) -> None:
    md = await key_for(backends)
    plain = f"http://localhost:{image_host.port}/cat.png"
    assert "scheme 'http'" in (await refused(stub, md, i2v(gateway_pb2.ImageInput(url=plain))))["image.url"]
    # 127.0.0.1 is not on the allow-list: a loopback address is refused before anything connects
    loopback = f"https://127.0.0.1:{image_host.port}/cat.png"
    assert "loopback" in (await refused(stub, md, i2v(gateway_pb2.ImageInput(url=loopback))))["image.url"]
    assert "credentials" in (await refused(stub, md, i2v(gateway_pb2.ImageInput(url="https://u:p@localhost/x"))))["image.url"]
    assert image_host.requests == []


async def test_an_image_host_with_an_unknown_certificate_is_refused(
    settings: Settings, backends: Backends, image_host: WebhookReceiver
) -> None:
    from services.submit.service import start

    untrusting = settings.model_copy(update={"input_fetch_ca_file": None})  # the system's CAs do not know the local one
    handle: SubmitHandle = await start(untrusting, backends)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
            stub = gateway_pb2_grpc.TaskGatewayStub(channel)
            violations = await refused(
                stub, await key_for(backends), i2v(gateway_pb2.ImageInput(url=image_host.url("/cat.png")))
            )
            assert "ConnectError" in violations["image.url"]
    finally:
        await handle.stop(0)


# ---------------------------------------------------------------- regenerate and retention


async def test_regenerate_keeps_the_image(stub: gateway_pb2_grpc.TaskGatewayAsyncStub, backends: Backends) -> None:
    md = await key_for(backends)
    first = await stub.SubmitTask(i2v(gateway_pb2.ImageInput(data=png())), metadata=md, timeout=10)
    out = await store.cancel(backends.pool, int(first.task.id), mode=store.CancelMode.HARD, actor="test", reason="test")
    assert out.applied
    again = await stub.RegenerateTask(gateway_pb2.RegenerateTaskRequest(task_id=first.task.id), metadata=md, timeout=10)
    assert again.created and again.task.image.sha256 == first.task.image.sha256
    assert again.task.params.seed != first.task.params.seed


@pytest.fixture
def scan_context(settings: Settings, backends: Backends) -> Iterator[ScanContext]:
    yield ScanContext(settings=settings, pool=backends.pool, bus=backends.bus)


async def test_retention_deletes_inputs_no_kept_task_runs_from(
    stub: gateway_pb2_grpc.TaskGatewayAsyncStub, backends: Backends, settings: Settings, scan_context: ScanContext
) -> None:
    md, other = await key_for(backends), await key_for(backends, "tenant-b")
    shared = png(color=(1, 1, 1))
    used = await stub.SubmitTask(i2v(gateway_pb2.ImageInput(data=png(color=(2, 2, 2)))), metadata=md, timeout=10)
    lone = (await upload(stub, md, png(color=(3, 3, 3)))).image
    mine, theirs = (await upload(stub, md, shared)).image, (await upload(stub, other, shared)).image
    assert mine.sha256 == theirs.sha256 and len(input_files(settings)) == 3
    week_later = datetime.now(UTC) + timedelta(days=8)
    await backends.pool.execute(
        "UPDATE task_input SET last_used_at = now() + interval '2 days' WHERE user_id = 'tenant-b'"
    )
    outcome = await RetentionScan(scan_context).purge(Retention(inputs=7 * 86400.0), now=week_later, limit=100)
    # tenant-a's lone upload and its copy of the shared one go; the shared object stays for tenant-b: the one
    # deleted object is the lone upload's
    assert outcome.actions[Action.PURGE_INPUT] == 2 and outcome.actions[Action.PURGE_RESULT] == 1
    left = {(r["user_id"], r["sha256"]) for r in await stored_inputs(backends)}
    assert left == {("tenant-a", used.task.image.sha256), ("tenant-b", theirs.sha256)}
    store = result_store(settings, backends.bus)
    with pytest.raises(ResultNotFound):
        async for _ in store.read(store.uri_of(images.object_name(lone.sha256))):
            pass
    assert {p.stem for p in input_files(settings)} == {used.task.image.sha256, theirs.sha256}
