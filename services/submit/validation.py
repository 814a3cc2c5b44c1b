"""SubmitTask requests checked and put in canonical form: defaults filled, limits enforced, callbacks SSRF-guarded."""

from __future__ import annotations

import hashlib
import json
import re
import secrets
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import urlsplit

from google.protobuf.message import Message

from taskgate import chat, errors, netguard, text, videoparams
from taskgate.config import GatewaySettings, ModelSpec
from taskgate.model import TaskRow
from taskgate.states import Priority
from taskgate.store.inputs import StoredInput
from taskgate_api import reasons
from taskgate_api.v1 import gateway_pb2, task_pb2

from . import chatcheck
from .chatcheck import MAX_SEED
from .inputs import Checked, InputImages

DEFAULT_TASK_TYPE = "text-to-video"
IMAGE_TASK_TYPES = frozenset({"image-to-video"})  # task types whose requests carry an input image
CALLBACK_EVENTS = frozenset({"CANCELED", "OUTPUT", "PROGRESS"})
_RANDOM_SEEDS = 2**32  # a seed every backend (torch, numpy) accepts
MAX_END_USER_BYTES = 128  # the task table's check (migrations/0032_end_users.sql)

# Control characters other than newline and tab.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


@dataclass(frozen=True, slots=True)
class Submission:
    """A valid request in canonical form: exactly what the task row stores."""

    task_type: str
    model_id: str
    prompt: str
    payload: dict[str, Any]
    priority: int
    idempotency_key: str
    key_derived: bool
    request_hash: str
    metadata: dict[str, str]
    callback_url: str | None
    callback_events: list[str]
    max_retries: int
    image: Checked | None = None  # image-to-video: checked, not yet kept (the payload then holds its sha256 alone)
    start_after: datetime | None = None  # a delayed start (scheduling, not the request: not in its hash)
    max_queue_seconds: float | None = None  # the queue's TTL (scheduling, not the request)
    end_user: str = ""  # the tenant's own user ('': the tenant itself); in the request hash and the key's scope

    def with_image(self, stored: StoredInput) -> Submission:
        """This submission once its image is kept: the payload names where the worker finds it."""
        return replace(self, payload={**self.payload, "image": stored.payload()}, image=None)

    def same_request(self, existing: TaskRow) -> bool:
        """Whether an existing task holding this idempotency key was made by this very request."""
        return (
            existing.request_hash == self.request_hash
            and existing.priority == self.priority
            and existing.callback_url == self.callback_url
            and sorted(existing.callback_events) == self.callback_events
            and existing.metadata == self.metadata
            and existing.max_retries == self.max_retries
        )


def check_priority(priority: int, allowed: int) -> None:
    """PERMISSION_DENIED (reason PRIORITY_NOT_ALLOWED) when the tenant may not submit at `priority`."""
    if priority > allowed:
        names = Priority.NAMES
        raise errors.permission_denied(
            f"this tenant may submit at {names[allowed].upper()} at most, not {names[priority].upper()}",
            reasons.PRIORITY_NOT_ALLOWED,
            requested=names[priority].upper(),
            allowed=names[allowed].upper(),
        )


def regenerate_request(
    source: TaskRow, *, seed: int | None, priority: int, idempotency_key: str
) -> gateway_pb2.SubmitTaskRequest:
    """A finished task's request again, with a new seed (random unless given), a fresh key unless given, at
    `priority`."""
    p = source.request_payload
    key = idempotency_key or f"regenerate-{source.id}-{secrets.token_hex(8)}"
    if source.task_type == chat.TASK_TYPE:
        return gateway_pb2.SubmitTaskRequest(
            task_type=source.task_type, model_id=source.model_id, chat=chat_params(p, seed=seed),
            priority=priority,  # type: ignore[arg-type]
            idempotency_key=key, callback_url=source.callback_url or "", callback_events=source.callback_events,
            metadata=source.metadata, max_retries=source.max_retries, end_user=source.end_user,
        )
    params = task_pb2.VideoParams(
        num_frames=p["num_frames"], width=p["width"], height=p["height"], num_inference_steps=p["num_inference_steps"],
        guidance_scale=p["guidance_scale"], fps=p["fps"], negative_prompt=p["negative_prompt"],
    )
    # always an explicit seed: a request without one would hash like the source's (when it had none either) and reuse
    # its kept output — a regenerate must render anew
    params.seed = seed if seed is not None else secrets.randbelow(_RANDOM_SEEDS)
    image = p.get("image")
    return gateway_pb2.SubmitTaskRequest(
        image=gateway_pb2.ImageInput(upload_sha256=image["sha256"]) if isinstance(image, dict) else None,
        task_type=source.task_type,
        model_id=source.model_id,
        prompt=source.prompt,
        params=params,
        priority=priority,  # type: ignore[arg-type]
        idempotency_key=key,
        callback_url=source.callback_url or "",
        callback_events=source.callback_events,
        metadata=source.metadata,
        max_retries=source.max_retries,
        end_user=source.end_user,  # the same person's task again
    )


def chat_params(payload: dict[str, Any], *, seed: int | None) -> task_pb2.ChatParams:
    """A stored chat request's parameters as sent, with a new seed (random unless given): a regenerate samples anew."""
    return task_pb2.ChatParams(
        messages=[task_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in chat.messages_of(payload)],
        max_output_tokens=payload["max_output_tokens"], temperature=payload["temperature"], top_p=payload["top_p"],
        stop=payload["stop"], seed=seed if seed is not None else secrets.randbelow(_RANDOM_SEEDS),
    )


def request_hash(
    tenant: str, task_type: str, model_id: str, prompt: str, params: dict[str, Any], end_user: str = ""
) -> str:
    """sha256 of what determines the output; `params` carries the seed the client gave (None if it gave none). An
    end user's requests hash apart from another's (two people sending one prompt get two tasks); the tenant's own
    hash as they always did."""
    fields: list[Any] = [tenant, task_type, model_id, prompt, params]
    if end_user:
        fields.append({"end_user": end_user})
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


async def check_callback_url(url: str, settings: GatewaySettings, *, resolve: bool = True) -> str | None:
    """Why a callback URL is refused, or None when a webhook may be sent to it (without `resolve`: as far as its text
    says)."""
    if len(url) > settings.max_callback_url_chars:
        return f"longer than {settings.max_callback_url_chars} characters"
    if (why := text.unstorable(url)) is not None:
        return why
    if _CONTROL.search(url) or any(c.isspace() for c in url):
        return "contains whitespace or control characters"
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return "not a valid URL"
    if parts.scheme not in ("http", "https"):
        return "must be an http or https URL"
    if parts.username is not None or parts.password is not None or "@" in parts.netloc:
        return "must not carry credentials"
    host = parts.hostname
    if not host:
        return "has no host"
    if not resolve or host in {h.lower() for h in settings.callback_allow_hosts}:
        return None  # an operator's own receiver is trusted and need not resolve at submit time
    try:
        await netguard.checked_address(
            host, port or (443 if parts.scheme == "https" else 80), within=settings.callback_resolve_timeout_seconds
        )
    except netguard.Refused as refused:
        return str(refused)
    return None


def _check_params(
    req: gateway_pb2.SubmitTaskRequest, spec: ModelSpec, settings: GatewaySettings, bad: list[tuple[str, str]]
) -> dict[str, Any]:
    """Fills defaults from the model spec, records each out-of-range value, returns the canonical parameters."""
    p = req.params
    params = videoparams.requested(p, spec)
    bad.extend(videoparams.violations(params, spec, max_fps=settings.max_fps))
    if p.HasField("seed") and not 0 <= p.seed <= MAX_SEED:
        bad.append(("params.seed", "must not be negative"))
    if p.negative_prompt and not spec.negative_prompt:
        bad.append(
            ("params.negative_prompt", f"model {req.model_id or settings.default_model} does not use a negative prompt")
        )
    elif len(p.negative_prompt) > settings.max_prompt_chars:
        bad.append(("params.negative_prompt", f"longer than {settings.max_prompt_chars} characters"))
    elif _CONTROL.search(p.negative_prompt):
        bad.append(("params.negative_prompt", "contains control characters"))
    else:
        text.check("params.negative_prompt", [p.negative_prompt], bad)
    return params.payload()


_VIDEO_FIELDS = tuple(f.name for f in task_pb2.VideoParams.DESCRIPTOR.fields)


def _refuse_video_params(req: gateway_pb2.SubmitTaskRequest, bad: list[tuple[str, str]]) -> None:
    """A chat task takes no video parameter: each one set is named (an empty `params` message is no parameter)."""
    for field, _ in req.params.ListFields():
        bad.append((f"params.{field.name}", f"task_type {chat.TASK_TYPE} takes no video parameters; use chat"))


def moment(request: Message, name: str, bad: list[tuple[str, str]]) -> datetime | None:
    """A request's timestamp field as a datetime (None when unset); out of the years 1-9999 (or not normalised) is a
    violation naming the field."""
    if not request.HasField(name):
        return None
    try:
        found: datetime = getattr(request, name).ToDatetime(tzinfo=UTC)
    except (ValueError, OverflowError):
        bad.append((name, "must be a time between the years 1 and 9999"))
        return None
    return found


def end_user_problem(end_user: str) -> str | None:
    """What is wrong with an end user id, or None (checked before it scopes any lookup)."""
    if len(end_user.encode(errors="surrogatepass")) > MAX_END_USER_BYTES:
        return f"longer than {MAX_END_USER_BYTES} bytes as UTF-8"
    if end_user and (not end_user.isprintable() or end_user != end_user.strip()):
        return "must be printable, without surrounding spaces"
    return text.unstorable(end_user)


def key_problem(key: str, settings: GatewaySettings) -> str | None:
    """What is wrong with an idempotency key, or None (checked before the key is looked up anywhere)."""
    if len(key) > settings.max_idempotency_key_chars:
        return f"longer than {settings.max_idempotency_key_chars} characters"
    if key and (not key.isprintable() or key != key.strip()):
        return "must be printable, without surrounding spaces"
    return None


async def validate(
    tenant: str, req: gateway_pb2.SubmitTaskRequest, settings: GatewaySettings, inputs: InputImages | None = None,
    *, within: float = 5.0, replay: bool = False,
) -> Submission:
    """The canonical submission, or INVALID_ARGUMENT naming every bad field.

    `replay`: the request's key already names a task, so its callback URL is not resolved (a rate-limited caller must
    not make us resolve): its answer is that task, or ALREADY_EXISTS when its URL differs from the task's.

    An input image is checked last, and only when every other field is valid: fetching and decoding it is the
    dearest check, not worth making for a request refused anyway.
    """
    bad: list[tuple[str, str]] = []
    prompt = req.prompt
    model_id = req.model_id or settings.default_model
    task_type = req.task_type or DEFAULT_TASK_TYPE
    is_chat = task_type == chat.TASK_TYPE
    if not is_chat:
        if not prompt.strip():
            bad.append(("prompt", "must not be empty"))
        elif len(prompt) > settings.max_prompt_chars:
            bad.append(("prompt", f"longer than {settings.max_prompt_chars} characters"))
        elif _CONTROL.search(prompt):
            bad.append(("prompt", "contains control characters"))
        else:
            text.check("prompt", [prompt], bad)

    spec = settings.models.get(model_id)
    params: dict[str, Any] = {}
    if is_chat:
        _refuse_video_params(req, bad)
    elif req.HasField("chat"):
        bad.append(("chat", f"task_type {task_type} takes no chat parameters; they are task_type {chat.TASK_TYPE}'s"))
    if spec is None:
        bad.append(("model_id", f"unknown model; known: {', '.join(sorted(settings.models))}"))
    else:
        if task_type not in spec.task_types:
            bad.append(("task_type", f"model {model_id} supports {', '.join(spec.task_types)}"))
        if is_chat:
            attached = await chatcheck.attachments(tenant, req, inputs, bad, within=within)
            params = chatcheck.check_chat(req, spec, settings, bad, attached)
        else:
            params = _check_params(req, spec, settings, bad)

    priority = req.priority or Priority.NORMAL
    if priority not in Priority.ALL:
        bad.append(("priority", "must be LOW, NORMAL or HIGH"))

    metadata = dict(sorted(req.metadata.items()))
    text.check("metadata", [*metadata, *metadata.values()], bad)
    as_json = json.dumps(metadata, separators=(",", ":"), ensure_ascii=False).encode(errors="surrogatepass")
    if len(as_json) > settings.max_metadata_bytes:
        bad.append(("metadata", f"larger than {settings.max_metadata_bytes} bytes as JSON"))

    key = req.idempotency_key
    if (why := key_problem(key, settings)) is not None:
        bad.append(("idempotency_key", why))
    end_user = req.end_user
    if (why := end_user_problem(end_user)) is not None:
        bad.append(("end_user", why))

    max_retries = req.max_retries if req.HasField("max_retries") else settings.max_retries
    if not 0 <= max_retries <= settings.max_task_retries:
        bad.append(("max_retries", f"must be 0..{settings.max_task_retries}"))

    start_after = moment(req, "start_after", bad)
    if start_after is not None and start_after > datetime.now(UTC) + timedelta(
        seconds=settings.max_start_delay_seconds
    ):
        bad.append(("start_after", f"is more than {settings.max_start_delay_seconds:g} s ahead"))
    max_queue_seconds = req.max_queue_seconds if req.HasField("max_queue_seconds") else None
    if max_queue_seconds is not None and not 0 < max_queue_seconds <= settings.max_queue_ttl_seconds:
        bad.append(("max_queue_seconds", f"must be above 0 and at most {settings.max_queue_ttl_seconds:g}"))

    events = sorted(set(req.callback_events))
    callback_url = req.callback_url or None
    if any(e not in CALLBACK_EVENTS for e in events):
        bad.append(("callback_events", f"each must be one of {', '.join(sorted(CALLBACK_EVENTS))}"))
    elif events and callback_url is None:
        bad.append(("callback_events", "need a callback_url"))
    if callback_url is not None:
        why = await check_callback_url(callback_url, settings, resolve=not replay)
        if why is not None:
            bad.append(("callback_url", why))

    wants_image = task_type in IMAGE_TASK_TYPES
    if wants_image and not req.HasField("image"):
        bad.append(("image", f"task_type {task_type} needs an input image"))
    elif req.HasField("image") and not wants_image:
        bad.append(("image", f"task_type {task_type} takes no image; use {', '.join(sorted(IMAGE_TASK_TYPES))}"))
    image: Checked | None = None
    if not bad and wants_image:
        assert spec is not None
        if inputs is None:
            bad.append(("image", "this gateway takes no input images"))
        else:
            image = await inputs.check(tenant, req.image, spec, bad, within=within)
            if image is not None:  # what the output depends on: the pixels, never where they came from
                params["image"] = image.sha256

    if not bad and is_chat:
        assert spec is not None
        await chatcheck.check_input_tokens(req, spec, params, bad)

    if bad:
        raise errors.invalid_argument(bad)

    if is_chat:  # the whole input is in the payload (and so in the hash); the prompt column shows its last user turn
        prompt = chat.preview(params[chat.MESSAGES], settings.max_prompt_chars)
        counted = params.pop(chat.INPUT_TOKENS)
        digest = request_hash(tenant, task_type, model_id, "", params, end_user)
        params[chat.INPUT_TOKENS] = counted
    else:
        digest = request_hash(tenant, task_type, model_id, prompt, params, end_user)
    if params["seed"] is None:
        params["seed"] = secrets.randbelow(_RANDOM_SEEDS)  # stored, so the task can be reproduced
    return Submission(
        task_type=task_type,
        model_id=model_id,
        prompt=prompt,
        payload=params,
        priority=priority,
        idempotency_key=key or digest,
        key_derived=not key,
        request_hash=digest,
        metadata=metadata,
        callback_url=callback_url,
        callback_events=events,
        max_retries=max_retries,
        image=image,
        start_after=start_after,
        max_queue_seconds=max_queue_seconds,
        end_user=end_user,
    )
