"""Hostile input to the gateway: every SubmitTask field, raw bytes and oversized messages on the port, other tenants'
ids."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import ipaddress
import json
import math
import os
import socket
import struct
import uuid
import zlib
from collections.abc import AsyncIterator
from typing import Any, cast

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st
from PIL import Image

from services.notifier.service import NotifierHandle
from services.notifier.service import start as start_notifier
from services.scheduler.service import start as start_scheduler
from services.submit.service import SubmitHandle
from services.submit.service import start as start_submit
from taskgate import auth, results, store
from taskgate.config import ModelSpec, Settings
from taskgate.runtime import Backends
from taskgate.states import Priority
from taskgate_api.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    events_pb2,
    events_pb2_grpc,
    gateway_pb2,
    gateway_pb2_grpc,
    task_pb2,
)
from tests.support import factories
from tests.support.factories import Claim, Metadata, insert_task, moved
from tests.support.harness import details_of, wait_for

# TASKGATE_HYPOTHESIS_EXAMPLES raises the example count for a longer hunt (e.g. 2000).
EXAMPLES = hsettings(
    max_examples=int(os.environ.get("TASKGATE_HYPOTHESIS_EXAMPLES", "40")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)

SPEC = ModelSpec(kind="sleep")
I2V_SPEC = ModelSpec(
    kind="sleep", task_types=["image-to-video"], max_image_width=256, max_image_height=256, max_image_bytes=200_000
)
MAX_PROMPT = Settings.model_fields["max_prompt_chars"].default
MAX_METADATA = Settings.model_fields["max_metadata_bytes"].default
MAX_KEY = Settings.model_fields["max_idempotency_key_chars"].default
MAX_URL = Settings.model_fields["max_callback_url_chars"].default
MAX_FPS = Settings.model_fields["max_fps"].default
MAX_RETRIES = Settings.model_fields["max_task_retries"].default
PUBLIC_HOOK = "http://93.184.216.34/hook"  # a public address literal: valid without DNS
INT32 = (-(2**31), 2**31 - 1)
CONTROL = [chr(c) for c in [*range(0x00, 0x09), *range(0x0B, 0x20), *range(0x7F, 0xA0)]]


# ---------------------------------------------------------------- fixtures and helpers


@pytest.fixture
def hostile_settings(settings: Settings) -> Settings:
    """No host is exempt from the SSRF guard; only the sleep model is registered."""
    return settings.model_copy(
        update={
            "callback_allow_hosts": [],
            "models": {"sleepy": SPEC, "sleepy-i2v": I2V_SPEC},
            "default_model": "sleepy",
            "result_store": "fs",
            "stream_keepalive_seconds": 0.2,
        }
    )


@pytest.fixture
async def gateway(hostile_settings: Settings, backends: Backends) -> AsyncIterator[SubmitHandle]:
    handle = await start_submit(hostile_settings, backends)
    try:
        yield handle
    finally:
        await handle.stop(0)


@pytest.fixture
async def channel(gateway: SubmitHandle) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}") as ch:
        yield ch


@pytest.fixture
def stub(channel: grpc.aio.Channel) -> Any:
    return gateway_pb2_grpc.TaskGatewayStub(channel)


async def key_for(backends: Backends, tenant: str) -> Metadata:
    """A key of `tenant` whose limits never get in the way of many requests."""
    return await factories.key_for(backends, tenant, max_pending=1_000_000, submits_per_minute=1_000_000)


async def failure(call: Any) -> tuple[grpc.StatusCode, list[Any]]:
    """The code and google.rpc details of a call that must fail."""
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    status = rpc_status.from_call(info.value)
    return info.value.code(), details_of(status) if status else []


def violated(details: list[Any]) -> set[str]:
    return {v.field for d in details if isinstance(d, error_details_pb2.BadRequest) for v in d.field_violations}


async def task_count(backends: Backends) -> int:
    return int(await backends.pool.fetchval("SELECT count(*) FROM task"))


def base_request(**fields: Any) -> gateway_pb2.SubmitTaskRequest:
    """A valid request, with `fields` replacing parts of it (params.* names a VideoParams field)."""
    params = task_pb2.VideoParams(num_frames=9, width=32, height=32, num_inference_steps=2, guidance_scale=5.0, fps=8)
    top: dict[str, Any] = {"prompt": "a red fox in the snow", "model_id": "sleepy"}
    for name, value in fields.items():
        if name.startswith("params."):
            setattr(params, name.removeprefix("params."), value)
        else:
            top[name] = value
    return gateway_pb2.SubmitTaskRequest(params=params, **top)


# ---------------------------------------------------------------- strategies: one bad field each


def _control_inside(min_size: int = 0) -> st.SearchStrategy[str]:
    return st.tuples(st.text(min_size=min_size, max_size=20), st.sampled_from(CONTROL), st.text(max_size=20)).map(
        lambda t: "a" + t[0] + t[1] + t[2]
    )


def _long(limit: int) -> st.SearchStrategy[str]:
    return st.integers(limit + 1, limit * 50).map(lambda n: "p" * n)


def _private_v4() -> st.SearchStrategy[str]:
    networks = ["127.0.0.0/8", "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "169.254.0.0/16", "100.64.0.0/10",
                "0.0.0.0/8", "224.0.0.0/4", "240.0.0.0/4", "198.18.0.0/15", "192.0.0.0/29"]
    return st.sampled_from(networks).flatmap(lambda n: st.ip_addresses(v=4, network=n)).map(str)


def _private_v6() -> st.SearchStrategy[str]:
    networks = ["::1/128", "fc00::/7", "fe80::/10", "ff00::/8", "::/128", "2001:db8::/32"]
    plain = st.sampled_from(networks).flatmap(lambda n: st.ip_addresses(v=6, network=n)).map(str)
    mapped = _private_v4().map(lambda a: f"::ffff:{a}")
    return st.one_of(plain, mapped)


def _numeric_forms(address: str) -> list[str]:
    """The spellings of one IPv4 address that getaddrinfo also accepts: decimal, hex, octal, short."""
    value = int(ipaddress.IPv4Address(address))
    a, b, c, d = (int(x) for x in address.split("."))
    return [str(value), hex(value), f"0{value:o}", f"{a}.{(b << 16) | (c << 8) | d}", f"0x{a:x}.{b}.{c}.{d}"]


def _bad_urls() -> st.SearchStrategy[str]:
    path = st.sampled_from(["/", "/hook", "/a?b=c", ""])
    v4 = st.builds(lambda host, p: f"http://{host}{p}", _private_v4(), path)
    v6 = st.builds(lambda host, p: f"https://[{host}]{p}", _private_v6(), path)
    numeric = _private_v4().flatmap(lambda a: st.sampled_from(_numeric_forms(a))).map(lambda h: f"http://{h}/hook")
    zone = st.sampled_from(["http://[fe80::1%25eth0]/", "http://[fe80::1%25lo]:8080/x"])
    userinfo = st.sampled_from([
        "http://user:pass@93.184.216.34/hook", "http://user@93.184.216.34/", "http://:@93.184.216.34/",
        "http://93.184.216.34@127.0.0.1/", "http://93.184.216.34:80@10.0.0.1/", "https://a%40b@93.184.216.34/",
    ])
    schemes = st.sampled_from(
        ["ftp", "file", "gopher", "javascript", "data", "ws", "wss", "dict", "ldap", "jar", "h"]
    ).map(lambda s: f"{s}://93.184.216.34/hook")
    names = st.sampled_from([
        "http://localhost/hook", "http://LOCALHOST:8080/", "http://localhost./", "http://vm/", "http://runsc:9/x",
        "http://ip6-localhost/", "http://does-not-exist.invalid/", "http://x.example./", "http://0/", "http://[::]/",
    ])
    malformed = st.sampled_from([
        "http:///hook", "http://:80/", "http://93.184.216.34:99999/", "http://93.184.216.34:-1/", "http://[::1/",
        "http://93.184.216.34/a b", "http://93.184.216.34/\x00", " http://93.184.216.34/", "//93.184.216.34/",
        "93.184.216.34/hook", "http:93.184.216.34", "http://[93.184.216.34]/", "\u202ehttp://93.184.216.34/",
    ])
    too_long = st.integers(MAX_URL + 1, MAX_URL * 4).map(lambda n: PUBLIC_HOOK + "/" + "a" * n)
    return st.one_of(v4, v6, numeric, zone, userinfo, schemes, names, malformed, too_long)


def _outside(low: int, high: int) -> st.SearchStrategy[int]:
    """int32 values below `low` or above `high` (0 excluded: it means 'the default')."""
    return st.one_of(st.integers(INT32[0], low - 1), st.integers(high + 1, INT32[1])).filter(lambda v: v != 0)


def _bad_sizes(limit: int) -> st.SearchStrategy[int]:
    return st.one_of(_outside(1, limit), st.integers(1, limit).filter(lambda v: v % SPEC.size_multiple != 0))


BAD_FIELD: st.SearchStrategy[tuple[str, dict[str, Any]]] = st.one_of(
    st.one_of(st.sampled_from(["", " ", "\n\t ", "\u3000"]), _long(MAX_PROMPT), _control_inside()).map(
        lambda v: ("prompt", {"prompt": v})
    ),
    st.text(min_size=1, max_size=300).filter(lambda v: v != "sleepy").map(lambda v: ("model_id", {"model_id": v})),
    st.text(min_size=1, max_size=300)
    .filter(lambda v: v != "text-to-video")
    .map(lambda v: ("task_type", {"task_type": v})),
    st.one_of(
        _outside(1, SPEC.max_frames), st.integers(2, SPEC.max_frames).filter(lambda n: (n - 1) % SPEC.frame_step != 0)
    ).map(lambda v: ("params.num_frames", {"params.num_frames": v})),
    _bad_sizes(SPEC.max_width).map(lambda v: ("params.width", {"params.width": v})),
    _bad_sizes(SPEC.max_height).map(lambda v: ("params.height", {"params.height": v})),
    _outside(1, SPEC.max_steps).map(lambda v: ("params.num_inference_steps", {"params.num_inference_steps": v})),
    st.one_of(
        st.floats(max_value=-0.5, width=32),
        st.floats(min_value=SPEC.max_guidance + 0.5, width=32),
        st.sampled_from([math.nan, math.inf, -math.inf]),
    ).map(lambda v: ("params.guidance_scale", {"params.guidance_scale": v})),
    _outside(1, MAX_FPS).map(lambda v: ("params.fps", {"params.fps": v})),
    st.integers(-(2**63), -1).map(lambda v: ("params.seed", {"params.seed": v})),
    st.one_of(_long(MAX_PROMPT), _control_inside()).map(
        lambda v: ("params.negative_prompt", {"params.negative_prompt": v})
    ),
    st.integers(*INT32).filter(lambda v: v not in (0, 1, 5, 10)).map(lambda v: ("priority", {"priority": v})),
    st.one_of(
        st.integers(MAX_METADATA, MAX_METADATA * 20).map(lambda n: {"k": "v" * n}),
        st.integers(MAX_METADATA // 8, MAX_METADATA).map(lambda n: {f"key-{i:05d}": "v" for i in range(n)}),
        st.integers(MAX_METADATA // 2, MAX_METADATA).map(lambda n: {"snow": "\u2603" * n}),
        st.text(max_size=10).map(lambda k: {k + "\x00": "v"}),  # jsonb cannot hold U+0000
        st.text(max_size=10).map(lambda v: {"k": v + "\x00" + v}),
    ).map(lambda v: ("metadata", {"metadata": v})),
    st.one_of(
        _long(MAX_KEY),
        st.tuples(st.text(max_size=20), st.sampled_from([*CONTROL, "\u2028", "\u200b"])).map(
            lambda t: "k" + t[0] + t[1] + "k"
        ),
        st.sampled_from([" key", "key ", "\tkey", " "]),
    ).map(lambda v: ("idempotency_key", {"idempotency_key": v})),
    _outside(0, MAX_RETRIES).map(lambda v: ("max_retries", {"max_retries": v})),
    st.one_of(
        st.lists(st.text(max_size=30).filter(lambda e: e not in ("CANCELED", "PROGRESS")), min_size=1, max_size=5).map(
            lambda v: {"callback_events": v, "callback_url": PUBLIC_HOOK}
        ),
        st.lists(st.sampled_from(["CANCELED", "PROGRESS"]), min_size=1, max_size=2).map(
            lambda v: {"callback_events": v}
        ),
    ).map(lambda v: ("callback_events", v)),
    _bad_urls().map(lambda v: ("callback_url", {"callback_url": v})),
)


# ---------------------------------------------------------------- SubmitTask, field by field


async def test_the_valid_base_request_is_accepted(stub: Any, backends: Backends) -> None:
    md = await key_for(backends, "tenant-a")
    resp = await stub.SubmitTask(
        base_request(callback_url=PUBLIC_HOOK, callback_events=["PROGRESS"]), metadata=md, timeout=10
    )
    assert resp.created and resp.task.status == task_pb2.TASK_STATUS_CREATED  # dispatched after the answer
    assert await task_count(backends) == 1


@EXAMPLES
@given(bad=BAD_FIELD)
async def test_every_bad_field_is_invalid_argument_and_stores_nothing(
    stub: Any, backends: Backends, bad: tuple[str, dict[str, Any]]
) -> None:
    field, changes = bad
    md = await key_for(backends, "tenant-a")
    before = await task_count(backends)  # an earlier failing example may have stored one (shrinking replays)
    code, details = await failure(stub.SubmitTask(base_request(**changes), metadata=md, timeout=10))
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (field, changes)
    assert field in violated(details), (field, violated(details))
    assert await task_count(backends) == before


ANY_TEXT = st.one_of(
    factories.any_text(60, surrogates=False), st.sampled_from(["", "sleepy", "text-to-video", PUBLIC_HOOK, "PROGRESS"])
)
ANY_INT = st.one_of(st.integers(*INT32), st.sampled_from([0, 1, 5, 9, 10, 16, 32]))


@EXAMPLES
@given(
    prompt=ANY_TEXT, model_id=ANY_TEXT, task_type=ANY_TEXT, key=ANY_TEXT, url=ANY_TEXT,
    events=st.lists(ANY_TEXT, max_size=3), metadata=st.dictionaries(
        factories.any_text(20, surrogates=False), factories.any_text(40, surrogates=False), max_size=4
    ),
    priority=ANY_INT, retries=st.one_of(st.none(), ANY_INT),
    params=st.fixed_dictionaries({
        "num_frames": ANY_INT, "width": ANY_INT, "height": ANY_INT, "num_inference_steps": ANY_INT, "fps": ANY_INT,
        "guidance_scale": st.floats(width=32), "negative_prompt": ANY_TEXT,
    }),
)
async def test_arbitrary_requests_get_ok_or_invalid_argument_never_an_internal_error(
    stub: Any, backends: Backends, prompt: str, model_id: str, task_type: str, key: str, url: str, events: list[str],
    metadata: dict[str, str], priority: int, retries: int | None, params: dict[str, Any],
) -> None:
    md = await key_for(backends, "tenant-a")
    request = gateway_pb2.SubmitTaskRequest(
        prompt=prompt, model_id=model_id, task_type=task_type, idempotency_key=key, callback_url=url,
        callback_events=events, metadata=metadata, priority=priority, params=task_pb2.VideoParams(**params),  # type: ignore[arg-type]
    )
    if retries is not None:
        request.max_retries = retries
    before = await task_count(backends)
    try:
        resp = await stub.SubmitTask(request, metadata=md, timeout=10)
    except grpc.aio.AioRpcError as exc:
        # ALREADY_EXISTS: an earlier example used the same idempotency key for another request.
        assert exc.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.ALREADY_EXISTS), exc
        assert await task_count(backends) == before
        return
    stored = await backends.pool.fetchrow("SELECT prompt, model_id FROM task WHERE id = $1", int(resp.task.id))
    assert stored is not None and (stored["prompt"], stored["model_id"]) == (prompt, "sleepy")
    assert await task_count(backends) == before + int(resp.created)


def _image_file(fmt: str, width: int, height: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), (width % 256, height % 256, 7)).save(out, format=fmt)
    return out.getvalue()


def _header_claiming(width: int, height: int) -> bytes:
    """A PNG signature and IHDR (valid CRC) claiming the sides, with no pixel data: tiny file, huge image."""
    chunk = b"IHDR" + struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + struct.pack(">I", 13) + chunk + struct.pack(">I", zlib.crc32(chunk))


VALID_IMAGES = st.builds(
    _image_file, st.sampled_from(["PNG", "JPEG", "WEBP"]), st.integers(1, 300), st.integers(1, 300)
)
IMAGE_DATA = st.one_of(
    st.binary(max_size=2000),
    VALID_IMAGES,
    st.tuples(VALID_IMAGES, st.integers(0, 400)).map(lambda t: t[0][: t[1]]),  # truncated anywhere
    st.tuples(VALID_IMAGES, st.integers(0, 64), st.integers(0, 255)).map(  # one byte of the header changed
        lambda t: t[0][: t[1]] + bytes([t[2]]) + t[0][t[1] + 1 :]
    ),
    st.tuples(VALID_IMAGES, st.binary(min_size=1, max_size=300)).map(lambda t: t[0] + t[1]),  # a polyglot's tail
    st.builds(_header_claiming, st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1)),
)
IMAGE_INPUTS = st.one_of(
    IMAGE_DATA.map(lambda d: gateway_pb2.ImageInput(data=d)),
    st.one_of(ANY_TEXT, st.sampled_from(["https://localhost/x.png", "https://169.254.169.254/x", "ftp://x/y", "https://"])).map(
        lambda u: gateway_pb2.ImageInput(url=u)
    ),
    st.one_of(ANY_TEXT, st.text("0123456789abcdef", min_size=64, max_size=64)).map(
        lambda h: gateway_pb2.ImageInput(upload_sha256=h)
    ),
    st.just(gateway_pb2.ImageInput()),
)


@EXAMPLES
@given(image=IMAGE_INPUTS)
async def test_any_input_image_is_ok_or_invalid_argument_naming_it_and_a_refusal_stores_nothing(
    stub: Any, backends: Backends, image: gateway_pb2.ImageInput
) -> None:
    md = await key_for(backends, "tenant-a")
    request = base_request(model_id="sleepy-i2v", task_type="image-to-video", image=image)
    inputs = await backends.pool.fetchval("SELECT count(*) FROM task_input")
    before = await task_count(backends)
    try:
        resp = await stub.SubmitTask(request, metadata=md, timeout=10)
    except grpc.aio.AioRpcError as exc:
        assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, exc
        status = rpc_status.from_call(exc)
        assert status is not None
        assert violated(details_of(status)) <= {"image", "image.data", "image.url", "image.upload_sha256"}, exc
        assert await task_count(backends) == before
        assert await backends.pool.fetchval("SELECT count(*) FROM task_input") == inputs
        return
    stored = Image.open(io.BytesIO(image.data))  # only inline data is accepted here: decodable and within limits
    assert (resp.task.image.width, resp.task.image.height) == stored.size or stored.getexif().get(0x0112)


# The string fields of SubmitTaskRequest, each as the wire bytes that carry a value in it (lone surrogates kept).
STRING_FIELDS: dict[str, Any] = {
    "prompt": lambda v: factories.wire_field(3, factories.wire_text(v)),
    "params.negative_prompt": lambda v: factories.wire_field(4, factories.wire_field(8, factories.wire_text(v))),
    "metadata": lambda v: factories.wire_field(
        9, factories.wire_field(1, factories.wire_text(v)) + factories.wire_field(2, b"v")
    ),
    "metadata ": lambda v: factories.wire_field(
        9, factories.wire_field(1, b"k") + factories.wire_field(2, factories.wire_text(v))
    ),
    "idempotency_key": lambda v: factories.wire_field(6, factories.wire_text(v)),
    "callback_url": lambda v: factories.wire_field(7, factories.wire_text(PUBLIC_HOOK + v)),
}


@EXAMPLES
@given(field=st.sampled_from(sorted(STRING_FIELDS)), value=factories.unstorable_text())
async def test_what_postgresql_cannot_store_is_invalid_argument_naming_the_field(
    channel: grpc.aio.Channel, backends: Backends, field: str, value: str
) -> None:
    md = await key_for(backends, "tenant-a")
    before = await task_count(backends)
    # Raw bytes: the protobuf library refuses to encode a lone surrogate, but a client elsewhere can send one.
    submit = channel.unary_unary(
        "/taskgate.v1.TaskGateway/SubmitTask", response_deserializer=gateway_pb2.SubmitTaskResponse.FromString
    )
    raw = base_request().SerializeToString() + STRING_FIELDS[field](value)  # a later field wins, or adds a map entry
    code, details = await failure(submit(raw, metadata=md, timeout=10))
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (field, value)
    assert field.strip() in violated(details), (field, violated(details))
    assert await task_count(backends) == before
    get = channel.unary_unary(
        "/taskgate.v1.TaskGateway/GetTask", response_deserializer=gateway_pb2.GetTaskResponse.FromString
    )
    code, details = await failure(get(factories.wire_field(1, factories.wire_text(value)), metadata=md, timeout=10))
    assert code == grpc.StatusCode.INVALID_ARGUMENT


@EXAMPLES
@given(task_id=st.one_of(st.text(max_size=40), st.integers(-(2**70), 2**70).map(str)))
async def test_any_task_id_is_not_found_or_invalid(stub: Any, backends: Backends, task_id: str) -> None:
    md = await key_for(backends, "tenant-a")
    wanted = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT)
    for call in (
        stub.GetTask(gateway_pb2.GetTaskRequest(task_id=task_id), metadata=md, timeout=5),
        stub.CancelTask(gateway_pb2.CancelTaskRequest(task_id=task_id, hard=True), metadata=md, timeout=5),
    ):
        code, _ = await failure(call)
        assert code in wanted, (task_id, code)
    code, _ = await failure(
        _drain(stub.GetTaskResult(gateway_pb2.GetTaskResultRequest(task_id=task_id), metadata=md, timeout=5))
    )
    assert code in wanted, (task_id, code)


@EXAMPLES
@given(token=st.one_of(st.text(max_size=200), st.binary(max_size=200).map(lambda b: b.hex())), size=st.integers(*INT32))
async def test_list_with_garbage_page_tokens_is_invalid_argument(
    stub: Any, backends: Backends, token: str, size: int
) -> None:
    md = await key_for(backends, "tenant-a")
    request = gateway_pb2.ListTasksRequest(page_token=token, page_size=size)
    try:
        await stub.ListTasks(request, metadata=md, timeout=5)
    except grpc.aio.AioRpcError as exc:
        assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, exc
    else:
        assert not token and size >= 0


async def _drain(call: Any) -> None:
    async for _ in call:
        pass


# ---------------------------------------------------------------- the port itself


GARBAGE = [
    b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 64,  # a TLS ClientHello to a plaintext port
    b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\xff" * 9,  # the HTTP/2 preface, then a frame of every bit set
    b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00" + b"\x00\xff\xff\x01\x00\x00\x00\x00\x01",
    b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00\xff\xff\xff\x01\x05\x00\x00\x00\x01",
    os.urandom(256 * 1024),
]


def _blast(port: int, data: bytes, keep_open: bool = False) -> socket.socket | None:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    with contextlib.suppress(OSError):  # the server may hang up before taking it all
        sock.sendall(data)
    if keep_open:
        return sock
    sock.close()
    return None


async def _still_serves(port: int, md: Metadata, prompt: str) -> None:
    """A fresh connection gets a normal answer."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as fresh:
        request = base_request(prompt=prompt, idempotency_key=uuid.uuid4().hex)
        resp = await gateway_pb2_grpc.TaskGatewayStub(fresh).SubmitTask(request, metadata=md, timeout=10)
        assert resp.created


@hsettings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(junk=st.one_of(st.binary(min_size=1, max_size=4096), st.sampled_from(GARBAGE)))
async def test_garbage_bytes_on_the_grpc_port_do_not_stop_the_server(
    gateway: SubmitHandle, stub: Any, backends: Backends, junk: bytes
) -> None:
    md = await key_for(backends, "tenant-a")
    await asyncio.to_thread(_blast, gateway.port, junk)
    await _still_serves(gateway.port, md, f"after {len(junk)} junk bytes {junk[:8].hex()}")


async def test_stalled_and_half_open_connections_do_not_block_others(gateway: SubmitHandle, backends: Backends) -> None:
    md = await key_for(backends, "tenant-a")
    stalled = [
        await asyncio.to_thread(_blast, gateway.port, data, True)
        for data in (
            b"",
            b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
            b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x10\x01\x04\x00\x00\x00\x01",
        )
        for _ in range(20)
    ]
    try:
        for i in range(3):
            await _still_serves(gateway.port, md, f"beside stalled connections {i}")
    finally:
        for sock in stalled:
            assert sock is not None
            sock.close()


async def test_oversized_message_is_resource_exhausted_and_the_server_goes_on(
    gateway: SubmitHandle, stub: Any, backends: Backends, hostile_settings: Settings
) -> None:
    md = await key_for(backends, "tenant-a")
    huge = "x" * (hostile_settings.grpc_max_message_bytes + 1024)
    code, _ = await failure(stub.SubmitTask(base_request(prompt=huge), metadata=md, timeout=30))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    code, _ = await failure(stub.SubmitTask(base_request(metadata={"k": huge}), metadata=md, timeout=30))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert await task_count(backends) == 0
    resp = await stub.SubmitTask(base_request(), metadata=md, timeout=10)
    assert resp.created
    await _still_serves(gateway.port, md, "after oversized messages")


async def test_huge_call_metadata_is_refused_and_the_server_goes_on(
    gateway: SubmitHandle, stub: Any, backends: Backends
) -> None:
    md = await key_for(backends, "tenant-a")
    for extra in ((("authorization", "Bearer " + "k" * 200_000),), (("x-request-id", "r" * 100_000), *md), tuple(
        (f"x-h{i}", "v" * 100) for i in range(2000)) + md):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.SubmitTask(base_request(prompt="big headers"), metadata=extra, timeout=10)
        assert info.value.code() != grpc.StatusCode.OK
    assert await task_count(backends) == 0
    await _still_serves(gateway.port, md, "after huge metadata")


# ---------------------------------------------------------------- other tenants' tasks


@pytest.fixture
async def notifier(hostile_settings: Settings, backends: Backends) -> AsyncIterator[NotifierHandle]:
    handle = await start_notifier(hostile_settings, backends)
    try:
        yield handle
    finally:
        await handle.stop()


async def _succeeded_task(backends: Backends, settings: Settings, tenant: str) -> int:
    """A task of `tenant` that SUCCEEDED with a stored result."""
    # a level of its own (low priority): the claim takes the level's fairest task, not one of the test's others
    task = await insert_task(backends.pool, user_id=tenant, model_id="sleepy", priority=Priority.LOW)
    results_store = results.result_store(settings, backends.bus)
    stored = await results_store.put(f"{task.id}-a1.json", b'{"ok": true}', "application/json")
    result = store.ResultRef(stored.uri, stored.content_type, stored.size, stored.sha256)
    for change in (store.Queue(), Claim("w1", 30.0), store.Succeed(result)):
        out = await moved(backends.pool, task.id, change)
        assert out.applied, change
    return task.id


async def _status_is(backends: Backends, task_id: str, status: str) -> bool:
    return bool(await backends.pool.fetchval("SELECT status::text FROM task WHERE id = $1", int(task_id)) == status)


async def test_other_tenants_tasks_are_not_found_on_every_rpc(
    stub: Any, backends: Backends, hostile_settings: Settings, notifier: NotifierHandle
) -> None:
    owner, prober = await key_for(backends, "tenant-a"), await key_for(backends, "tenant-b")
    queued = (await stub.SubmitTask(base_request(prompt="tenant a's secret"), metadata=owner, timeout=10)).task.id
    await wait_for(lambda: _status_is(backends, queued, "QUEUED"))  # the dispatcher queues it after the answer
    done = str(await _succeeded_task(backends, hostile_settings, "tenant-a"))
    missing = str(int(done) + 12345)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{notifier.port}") as ch:
        events: Any = events_pb2_grpc.TaskEventsStub(ch)
        for task_id in (queued, done, missing):
            probes = [
                stub.GetTask(gateway_pb2.GetTaskRequest(task_id=task_id), metadata=prober, timeout=5),
                stub.CancelTask(gateway_pb2.CancelTaskRequest(task_id=task_id, hard=True), metadata=prober, timeout=5),
                _drain(
                    stub.GetTaskResult(gateway_pb2.GetTaskResultRequest(task_id=task_id), metadata=prober, timeout=5)
                ),
                _drain(events.WatchTask(events_pb2.WatchTaskRequest(task_id=task_id), metadata=prober, timeout=5)),
                _drain(
                    events.WatchTask(
                        events_pb2.WatchTaskRequest(task_id=task_id, after_version=1), metadata=prober, timeout=5
                    )
                ),
            ]
            for probe in probes:
                code, details = await failure(probe)
                assert code == grpc.StatusCode.NOT_FOUND, (task_id, code)
                assert [d.reason for d in details if isinstance(d, error_details_pb2.ErrorInfo)] == ["NOT_FOUND"]
        listed = await stub.ListTasks(gateway_pb2.ListTasksRequest(), metadata=prober, timeout=5)
        assert list(listed.tasks) == []
        # The owner still sees both, untouched by the probes.
        mine = await stub.ListTasks(gateway_pb2.ListTasksRequest(), metadata=owner, timeout=5)
        assert {t.id for t in mine.tasks} == {queued, done}
        assert {t.status for t in mine.tasks} == {task_pb2.TASK_STATUS_QUEUED, task_pb2.TASK_STATUS_SUCCEEDED}


async def test_watch_tasks_never_shows_another_tenants_events(
    stub: Any, backends: Backends, hostile_settings: Settings, notifier: NotifierHandle
) -> None:
    owner, prober = await key_for(backends, "tenant-a"), await key_for(backends, "tenant-b")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{notifier.port}") as ch:
        events: Any = events_pb2_grpc.TaskEventsStub(ch)
        call = events.WatchTasks(events_pb2.WatchTasksRequest(), metadata=prober, timeout=30)
        seen: list[task_pb2.TaskEvent] = []
        live = asyncio.Event()

        async def collect() -> None:
            async for item in call:
                live.set()  # the first keep-alive: the subscription is in place
                if item.HasField("event"):
                    seen.append(item.event)
                    if item.event.user_id == "tenant-b":
                        return

        reader = asyncio.create_task(collect())
        await asyncio.wait_for(live.wait(), 10)
        for i in range(3):
            await stub.SubmitTask(base_request(prompt=f"a's task {i}"), metadata=owner, timeout=10)
        await _succeeded_task(backends, hostile_settings, "tenant-a")
        # tenant-b's own task, last: once its event arrives, every earlier event had its chance to leak.
        mine = await stub.SubmitTask(base_request(prompt="b's own"), metadata=prober, timeout=10)
        await asyncio.wait_for(reader, 20)
        call.cancel()
    assert seen and all(e.user_id == "tenant-b" and e.task_id == mine.task.id for e in seen)


# ---------------------------------------------------------------- every RPC, every field: OK or a named refusal


@pytest.fixture
async def admin_channel(hostile_settings: Settings, backends: Backends) -> AsyncIterator[grpc.aio.Channel]:
    handle = await start_scheduler(hostile_settings, backends, scan_loop=False)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}") as ch:
            yield ch
    finally:
        await handle.stop(0)


# (service, method, request class, how it is called): each read in full (unary) or to its first message (streams)
RPCS: list[tuple[str, str, type[Any], str]] = [
    ("gateway", "SubmitTask", gateway_pb2.SubmitTaskRequest, "unary"),
    ("gateway", "SubmitTasks", gateway_pb2.SubmitTasksRequest, "unary"),
    ("gateway", "SubmitStream", gateway_pb2.SubmitStreamRequest, "bidi"),
    ("gateway", "GetTask", gateway_pb2.GetTaskRequest, "unary"),
    ("gateway", "ListTasks", gateway_pb2.ListTasksRequest, "unary"),
    ("gateway", "CancelTask", gateway_pb2.CancelTaskRequest, "unary"),
    ("gateway", "RegenerateTask", gateway_pb2.RegenerateTaskRequest, "unary"),
    ("gateway", "GetTaskResult", gateway_pb2.GetTaskResultRequest, "stream"),
    ("gateway", "UploadInput", gateway_pb2.UploadInputRequest, "client-stream"),
    ("events", "WatchTask", events_pb2.WatchTaskRequest, "stream"),
    ("events", "WatchTasks", events_pb2.WatchTasksRequest, "stream"),
    ("admin", "GetStats", admin_pb2.GetStatsRequest, "unary"),
    ("admin", "ListTasks", admin_pb2.AdminListTasksRequest, "unary"),
    ("admin", "ListStuckTasks", admin_pb2.ListStuckTasksRequest, "unary"),
    ("admin", "RequeueTasks", admin_pb2.RequeueTasksRequest, "stream"),
    ("admin", "ListDeadLetters", admin_pb2.ListDeadLettersRequest, "unary"),
    ("admin", "RedeliverCallback", admin_pb2.RedeliverCallbackRequest, "unary"),
    ("admin", "ListCallbackDeliveries", admin_pb2.ListCallbackDeliveriesRequest, "unary"),
    ("admin", "ListApiKeys", admin_pb2.ListApiKeysRequest, "unary"),
    ("admin", "PurgeTasks", admin_pb2.PurgeTasksRequest, "unary"),
]
# what a client may hear for input it made up: a named refusal or a plain answer, never a server fault
FINE = {
    grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.OUT_OF_RANGE,
}


@pytest.mark.parametrize(("service", "method", "request_type", "kind"), RPCS, ids=[f"{s}.{m}" for s, m, _, _ in RPCS])
@EXAMPLES
@given(data=st.data())
async def test_any_request_to_any_rpc_is_answered_or_refused_by_name_never_internal_or_unavailable(
    service: str, method: str, request_type: type[Any], kind: str, data: st.DataObject,
    channel: grpc.aio.Channel, notifier: NotifierHandle, admin_channel: grpc.aio.Channel, backends: Backends,
) -> None:
    request = data.draw(factories.proto_messages(request_type), label="request")
    if service == "admin":
        key, _ = await auth.create_key(backends.pool, "taskgate-dev-pepper", "ops", admin=True)
        md: Metadata = (("authorization", f"Bearer {key}"),)
        stub: Any = admin_pb2_grpc.TaskAdminStub(admin_channel)
    else:
        md = await key_for(backends, "tenant-a")
        if service == "events":
            events_channel = grpc.aio.insecure_channel(f"127.0.0.1:{notifier.port}")
            stub = events_pb2_grpc.TaskEventsStub(events_channel)
        else:
            stub = gateway_pb2_grpc.TaskGatewayStub(channel)
    call = getattr(stub, method)
    try:
        if kind == "unary":
            await call(request, metadata=md, timeout=10)
        elif kind == "client-stream":
            parts = data.draw(st.lists(factories.proto_messages(request_type), max_size=3), label="parts")

            async def stream() -> AsyncIterator[Any]:
                for part in [request, *parts]:
                    yield part

            await call(stream(), metadata=md, timeout=10)
        elif kind == "bidi":  # one request, its answer: a refusal of the request is its answer's status, not the call's

            async def one() -> AsyncIterator[Any]:
                yield request

            responses = call(one(), metadata=md, timeout=10)
            async for answer in responses:
                if answer.result.HasField("error"):
                    code = next(c for c in grpc.StatusCode if c.value[0] == answer.result.error.code)
                    # a request's own timeout is its deadline, as a call's is: a short one may pass
                    timeout = cast(gateway_pb2.SubmitStreamRequest, request).timeout
                    own = timeout.ToNanoseconds() / 1e9 if request.HasField("timeout") else None
                    short = {grpc.StatusCode.DEADLINE_EXCEEDED} if own is not None and own < 10 else set()
                    assert code in FINE | short, (method, request, code, answer.result.error.message)
                    if code is grpc.StatusCode.INVALID_ARGUMENT:
                        assert violated(details_of(answer.result.error)), (method, answer.result.error.message)
            assert await responses.code() is grpc.StatusCode.OK
        else:
            responses = call(request, metadata=md, timeout=10)
            async for _ in responses:
                break
            responses.cancel()
    except grpc.aio.AioRpcError as exc:
        assert exc.code() in FINE, (method, request, exc.code(), exc.details())
        if exc.code() is grpc.StatusCode.INVALID_ARGUMENT:
            status = rpc_status.from_call(exc)
            assert status is not None and violated(details_of(status)), (method, exc.details())  # names a field
    finally:
        if service == "events":
            await events_channel.close()


async def test_the_reported_out_of_range_inputs_are_invalid_argument_naming_their_field(
    stub: Any, notifier: NotifierHandle, backends: Backends
) -> None:
    """The inputs a security review found answered INTERNAL (or UNAVAILABLE, which the SDK retries)."""
    md = await key_for(backends, "tenant-a")
    past_int64 = base64.urlsafe_b64encode(json.dumps({"c": 0, "i": str(2**64), "f": "x"}).encode()).decode().rstrip("=")
    code, details = await failure(
        stub.ListTasks(gateway_pb2.ListTasksRequest(page_token=past_int64), metadata=md, timeout=10)
    )
    assert (code, violated(details)) == (grpc.StatusCode.INVALID_ARGUMENT, {"page_token"})
    year_10000 = gateway_pb2.ListTasksRequest()
    year_10000.created_after.seconds = 253_402_300_800  # 10000-01-01
    code, details = await failure(stub.ListTasks(year_10000, metadata=md, timeout=10))
    assert (code, violated(details)) == (grpc.StatusCode.INVALID_ARGUMENT, {"created_after"})
    async with grpc.aio.insecure_channel(f"127.0.0.1:{notifier.port}") as ch:
        events = events_pb2_grpc.TaskEventsStub(ch)
        for cursor in ("99999999999999999999", "-5"):
            call = events.WatchTasks(events_pb2.WatchTasksRequest(cursor=cursor), metadata=md, timeout=10)
            code, details = await failure(_drain(call))
            assert (code, violated(details)) == (grpc.StatusCode.INVALID_ARGUMENT, {"cursor"}), cursor


async def test_page_tokens_are_signed_and_bound_to_their_filter(stub: Any, backends: Backends) -> None:
    md = await key_for(backends, "tenant-a")
    for _ in range(3):
        await stub.SubmitTask(base_request(prompt=f"page {uuid.uuid4()}"), metadata=md, timeout=10)
    first = await stub.ListTasks(gateway_pb2.ListTasksRequest(page_size=1), metadata=md, timeout=10)
    token = first.next_page_token
    assert token
    second = await stub.ListTasks(gateway_pb2.ListTasksRequest(page_size=1, page_token=token), metadata=md, timeout=10)
    assert second.tasks[0].id != first.tasks[0].id
    data = json.loads(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)))
    for forged in (
        {**data, "i": str(int(data["i"]) + 1)},
        {**data, "c": 0},
        {k: v for k, v in data.items() if k != "s"},
    ):
        raw = base64.urlsafe_b64encode(json.dumps(forged).encode()).decode().rstrip("=")
        code, details = await failure(
            stub.ListTasks(gateway_pb2.ListTasksRequest(page_size=1, page_token=raw), metadata=md, timeout=10)
        )
        assert (code, violated(details)) == (grpc.StatusCode.INVALID_ARGUMENT, {"page_token"}), forged
    other_filter = gateway_pb2.ListTasksRequest(page_size=1, page_token=token, statuses=[task_pb2.TASK_STATUS_QUEUED])
    code, details = await failure(stub.ListTasks(other_filter, metadata=md, timeout=10))
    assert (code, violated(details)) == (grpc.StatusCode.INVALID_ARGUMENT, {"page_token"})


async def test_an_unknown_key_repeated_reaches_the_database_once(
    stub: Any, backends: Backends, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A caller hammering with a wrong key costs one lookup per cache period, not one per call."""
    from taskgate.store import tenants

    lookups: list[str] = []
    real = tenants.lookup_api_key

    async def counted(db: Any, digest: str) -> Any:
        lookups.append(digest)
        return await real(db, digest)

    monkeypatch.setattr(tenants, "lookup_api_key", counted)
    wrong = (("authorization", "Bearer tg_" + uuid.uuid4().hex),)
    for _ in range(50):
        code, _details = await failure(
            stub.GetTask(gateway_pb2.GetTaskRequest(task_id="1"), metadata=wrong, timeout=10)
        )
        assert code == grpc.StatusCode.UNAUTHENTICATED
    assert len(lookups) == 1
    good = await key_for(backends, "tenant-a")  # a real key is still looked up (and then cached) as before
    await stub.ListTasks(gateway_pb2.ListTasksRequest(), metadata=good, timeout=10)
    assert len(lookups) == 2
