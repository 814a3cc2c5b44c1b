"""The request messages the client sends, built from its calls' arguments: a task's submission (video or chat), a
status filter, a duration."""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping
from datetime import datetime
from pathlib import Path

from google.protobuf import duration_pb2

from taskgate_api.v1 import gateway_pb2, task_pb2
from taskgate_client.types import CHAT, ChatInput, ImageSource, Status, priority_value

StatusFilter = str | Status | Iterable[str | Status] | None


def wire_statuses(status: StatusFilter) -> list[task_pb2.TaskStatus.ValueType]:
    if status is None:
        return []
    items = [status] if isinstance(status, str) else list(status)
    return [Status(str(s).upper()).to_proto() for s in items]


def duration(seconds: float) -> duration_pb2.Duration:
    d = duration_pb2.Duration()
    d.FromNanoseconds(int(seconds * 1e9))
    return d


def submit_request(
    prompt: str = "",
    model: str | None = None,
    *,
    frames: int | None = None,
    width: int | None = None,
    height: int | None = None,
    steps: int | None = None,
    guidance: float | None = None,
    fps: int | None = None,
    seed: int | None = None,
    negative_prompt: str = "",
    priority: str | int = "normal",
    idempotency_key: str | None = None,
    callback_url: str | None = None,
    callback_events: Iterable[str] = (),
    metadata: Mapping[str, str] | None = None,
    max_retries: int | None = None,
    task_type: str | None = None,
    image: gateway_pb2.ImageInput | None = None,
    start_after: datetime | None = None,
    max_queue_seconds: float | None = None,
    end_user: str | None = None,
) -> gateway_pb2.SubmitTaskRequest:
    """The SubmitTaskRequest for submit()'s arguments; a fresh idempotency key unless one is given. The task type
    defaults to image-to-video with an image, text-to-video without."""
    params = task_pb2.VideoParams(
        num_frames=frames or 0,
        width=width or 0,
        height=height or 0,
        num_inference_steps=steps or 0,
        guidance_scale=guidance or 0.0,
        fps=fps or 0,
        negative_prompt=negative_prompt,
    )
    if seed is not None:
        params.seed = seed
    request = gateway_pb2.SubmitTaskRequest(
        task_type=task_type or ("image-to-video" if image is not None else "text-to-video"),
        model_id=model or "",
        prompt=prompt,
        params=params,
        priority=priority_value(priority),
        idempotency_key=idempotency_key or str(uuid.uuid4()),
        callback_url=callback_url or "",
        callback_events=list(callback_events),
        metadata=dict(metadata or {}),
        image=image,
        end_user=end_user or "",
    )
    if max_retries is not None:
        request.max_retries = max_retries
    if start_after is not None:
        request.start_after.FromDatetime(start_after if start_after.tzinfo else start_after.astimezone())
    if max_queue_seconds is not None:
        request.max_queue_seconds = max_queue_seconds
    return request


def chat_request(
    messages: ChatInput,
    model: str | None = None,
    *,
    system: str | None = None,
    max_output_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    stop: Iterable[str] = (),
    seed: int | None = None,
    priority: str | int = "normal",
    idempotency_key: str | None = None,
    callback_url: str | None = None,
    callback_events: Iterable[str] = (),
    metadata: Mapping[str, str] | None = None,
    max_retries: int | None = None,
    start_after: datetime | None = None,
    max_queue_seconds: float | None = None,
    end_user: str | None = None,
) -> gateway_pb2.SubmitTaskRequest:
    """The SubmitTaskRequest of a chat task: `messages` is the user's one message (a str) or the conversation
    ({"role": ..., "content": ...} each, oldest first); `system` goes first as a system message."""
    turns = [{"role": "user", "content": messages}] if isinstance(messages, str) else [dict(m) for m in messages]
    if system is not None:
        turns.insert(0, {"role": "system", "content": system})
    params = task_pb2.ChatParams(
        messages=[
            task_pb2.ChatMessage(
                role=t.get("role", ""), content=t.get("content", ""), content_sha256=t.get("content_sha256", "")
            )
            for t in turns
        ],
        stop=list(stop),
    )
    for name, value in (
        ("max_output_tokens", max_output_tokens),
        ("temperature", temperature),
        ("top_p", top_p),
        ("seed", seed),
    ):
        if value is not None:
            setattr(params, name, value)
    request = submit_request(
        "", model, priority=priority, idempotency_key=idempotency_key, callback_url=callback_url,
        callback_events=callback_events, metadata=metadata, max_retries=max_retries, task_type=CHAT,
        start_after=start_after, max_queue_seconds=max_queue_seconds, end_user=end_user,
    )
    request.ClearField("params")
    request.chat.CopyFrom(params)
    return request


def read_image(image: ImageSource) -> bytes | str:
    """An image source as bytes to send, or as the https URL the gateway fetches."""
    if isinstance(image, bytes):
        return image
    if isinstance(image, str) and image.startswith(("https://", "http://")):
        return image
    return Path(image).read_bytes()
