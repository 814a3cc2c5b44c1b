"""SubmitTask's validation without a stack: every bad field named, the valid edges accepted, the callback SSRF guard."""

from __future__ import annotations

import ipaddress
from typing import Any

import grpc
import pytest

from services.submit.validation import check_callback_url, validate
from taskgate import errors
from taskgate.config import Settings
from taskgate.netguard import forbidden_address
from taskgate_api.v1 import gateway_pb2, task_pb2
from tests.support.harness import details_of, violations


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"prompt": "x" * 2001}, "prompt"),
        ({"prompt": "tab\tok but nul\x00 not"}, "prompt"),
        ({"prompt": "ok", "model_id": "no-such-model"}, "model_id"),
        ({"prompt": "ok", "params": task_pb2.VideoParams(num_frames=85)}, "params.num_frames"),
        ({"prompt": "ok", "params": task_pb2.VideoParams(width=1296)}, "params.width"),
        ({"prompt": "ok", "params": task_pb2.VideoParams(guidance_scale=float("nan"))}, "params.guidance_scale"),
        ({"prompt": "ok", "callback_url": "http://user:pw@127.0.0.1/hook"}, "callback_url"),
        ({"prompt": "ok", "callback_events": ["PROGRESS"]}, "callback_events"),
    ],
)
async def test_single_bad_field(settings: Settings, fields: dict[str, Any], field: str) -> None:
    with pytest.raises(errors.ApiError) as info:
        await validate("tenant-a", gateway_pb2.SubmitTaskRequest(**fields), settings)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert violations(details_of(info.value.status_proto)) == {field}


async def test_valid_edges_are_accepted(settings: Settings) -> None:
    spec = settings.models["wan-tiny"]
    params = task_pb2.VideoParams(num_frames=spec.max_frames, width=spec.max_width, height=16,
                                  num_inference_steps=spec.max_steps, guidance_scale=spec.max_guidance)
    sub = await validate(
        "tenant-a", gateway_pb2.SubmitTaskRequest(prompt="line one\n\tline two", params=params), settings
    )
    assert sub.payload["num_frames"] == spec.max_frames and sub.priority == 5 and sub.key_derived
    same = await validate(
        "tenant-a", gateway_pb2.SubmitTaskRequest(prompt="line one\n\tline two", params=params), settings
    )
    other_tenant = await validate(
        "tenant-b", gateway_pb2.SubmitTaskRequest(prompt="line one\n\tline two", params=params), settings
    )
    assert sub.idempotency_key == same.idempotency_key == sub.request_hash != other_tenant.idempotency_key


@pytest.mark.parametrize(
    "url",
    [
        "http://localhost:8080/hook",  # a name resolving to 127.0.0.1
        "http://169.254.169.254/latest/meta-data/",
        "http://[fd00:ec2::254]/",
        "http://2130706433/hook",  # 127.0.0.1 as one decimal number
        "http://0x7f.1/hook",
        "http://[::1]:8080/hook",
        "http://[::ffff:127.0.0.1]/hook",
        "http://10.1.2.3/hook",
        "http://192.168.0.10/hook",
        "http://100.100.100.200/hook",
        "http://0.0.0.0/hook",
        "http://224.0.0.1/hook",
        "https://no-such-host.invalid/hook",
        "file:///etc/passwd",
        "http:///no-host",
    ],
)
async def test_callback_urls_refused(settings: Settings, url: str) -> None:
    assert await check_callback_url(url, settings) is not None


def test_forbidden_address_ranges() -> None:
    bad = ["127.0.0.1", "10.0.0.1", "172.16.5.4", "192.168.1.1", "169.254.1.1", "169.254.169.254", "100.64.0.1",
           "0.0.0.0", "240.0.0.1", "224.0.0.5", "::1", "::", "fe80::1", "fc00::1", "fd00:ec2::254", "ff02::1",
           "::ffff:10.0.0.1", "192.0.0.8", "fec0::1", "2002:7f00:1::1", "2001:db8::1"]
    good = ["93.184.216.34", "8.8.8.8", "2606:4700:4700::1111"]
    assert all(forbidden_address(ipaddress.ip_address(a)) for a in bad)
    assert not any(forbidden_address(ipaddress.ip_address(a)) for a in good)
