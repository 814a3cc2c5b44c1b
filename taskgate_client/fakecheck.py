"""The fake taskgate's checks of a submission (see taskgate_client.testing): the services' rules for a model's
request, chat messages, an input image and text attachments, as INVALID_ARGUMENT naming every bad field."""

from __future__ import annotations

import hashlib
from typing import Any

from taskgate_api.v1 import gateway_pb2, task_pb2
from taskgate_client.fakerpc import _invalid
from taskgate_client.fakestate import _IMAGE_SIGNATURES, CALLBACK_EVENTS, CHAT, FakeTaskgateState


class FakeChecks(FakeTaskgateState):
    """What the fake refuses in a submission, as the gateway's validation does."""

    def _check(self, req: gateway_pb2.SubmitTaskRequest) -> tuple[str, dict[str, Any]]:
        """INVALID_ARGUMENT naming every bad field (the services' rules for a default model), or the model and
        params."""
        bad: list[tuple[str, str]] = []
        if (req.task_type or "text-to-video") == CHAT:
            return self._check_chat(req, bad)
        if req.HasField("chat"):
            bad.append(("chat", "only a chat task takes chat parameters"))
        if not req.prompt.strip():
            bad.append(("prompt", "must not be empty"))
        model = req.model_id or self.default_model
        if model not in self.models:
            bad.append(("model_id", f"unknown model; known: {', '.join(sorted(self.models))}"))
        served = (
            "image-to-video" if model in self.image_models else CHAT if model in self.chat_models else "text-to-video"
        )
        task_type = req.task_type or "text-to-video"
        if task_type != served:
            bad.append(("task_type", f"model {model} supports {served}"))
        image = self._image(req, task_type, bad)
        lim, p = self.limits, req.params
        frames = p.num_frames or lim.default_frames
        if frames < 1 or frames > lim.max_frames or (frames - 1) % lim.frame_step:
            bad.append(
                ("params.num_frames", f"must be 1..{lim.max_frames} with num_frames - 1 a multiple of {lim.frame_step}")
            )
        width, height = p.width or lim.default_width, p.height or lim.default_height
        for name, size in (("width", width), ("height", height)):
            if size < 1 or size > lim.max_size or size % lim.size_multiple:
                bad.append((f"params.{name}", f"must be a multiple of {lim.size_multiple} up to {lim.max_size}"))
        steps = p.num_inference_steps or lim.default_steps
        if steps < 1 or steps > lim.max_steps:
            bad.append(("params.num_inference_steps", f"must be 1..{lim.max_steps}"))
        guidance = p.guidance_scale or lim.default_guidance
        if guidance < 0 or guidance > lim.max_guidance:
            bad.append(("params.guidance_scale", f"must be 0..{lim.max_guidance}"))
        fps = p.fps or lim.default_fps
        if fps < 1 or fps > lim.max_fps:
            bad.append(("params.fps", f"must be 1..{lim.max_fps}"))
        if p.HasField("seed") and p.seed < 0:
            bad.append(("params.seed", "must not be negative"))
        if req.HasField("max_retries") and not 0 <= req.max_retries <= 10:
            bad.append(("max_retries", "must be 0..10"))
        if req.HasField("max_queue_seconds") and not 0 < req.max_queue_seconds <= 7 * 86400:
            bad.append(("max_queue_seconds", "must be above 0 and at most 604800"))
        events = set(req.callback_events)
        if events - CALLBACK_EVENTS:
            bad.append(("callback_events", f"each must be one of {', '.join(sorted(CALLBACK_EVENTS))}"))
        elif events and not req.callback_url:
            bad.append(("callback_events", "need a callback_url"))
        if req.callback_url and not req.callback_url.startswith(("http://", "https://")):
            bad.append(("callback_url", "must be an http or https URL"))
        if bad:
            raise _invalid(bad)
        params = {
            "num_frames": frames, "width": width, "height": height, "num_inference_steps": steps,
            "guidance_scale": round(guidance, 4), "fps": fps, "seed": p.seed if p.HasField("seed") else None,
            "negative_prompt": p.negative_prompt,
        }
        if image is not None:
            params["image"] = image
        return model, params

    def _check_chat(self, req: gateway_pb2.SubmitTaskRequest, bad: list[tuple[str, str]]) -> tuple[str, dict[str, Any]]:
        """A chat request by the services' rules (no token count: the fake has no tokenizer), or INVALID_ARGUMENT."""
        model = req.model_id or self.default_model
        if model not in self.chat_models:
            bad.append(("model_id" if model not in self.models else "task_type", f"model {model} serves no chat tasks"))
        for given, _ in req.params.ListFields():
            bad.append((f"params.{given.name}", "a chat task takes no video parameters; use chat"))
        c = req.chat
        if c.messages and req.prompt:
            bad.append(("prompt", "give the prompt or chat.messages, not both"))
        messages = [{"role": m.role, "content": self._attached(m, i, bad)} for i, m in enumerate(c.messages)] or [
            {"role": "user", "content": req.prompt}]
        for i, m in enumerate(messages):
            if m["role"] not in ("system", "user", "assistant"):
                bad.append((f"chat.messages[{i}].role", "must be one of system, user, assistant"))
        if messages[-1]["role"] != "user" or not messages[-1]["content"].strip():
            bad.append(("chat.messages" if c.messages else "prompt", "must end with a user message that is not empty"))
        max_tokens = c.max_output_tokens if c.HasField("max_output_tokens") else 256
        if max_tokens < 1:
            bad.append(("chat.max_output_tokens", "must be at least 1"))
        if c.HasField("temperature") and not 0 <= c.temperature <= 2:
            bad.append(("chat.temperature", "must be 0..2"))
        if c.HasField("top_p") and not 0 < c.top_p <= 1:
            bad.append(("chat.top_p", "must be above 0 and at most 1"))
        if c.HasField("seed") and c.seed < 0:
            bad.append(("chat.seed", "must not be negative"))
        if bad:
            raise _invalid(bad)
        return model, {
            "messages": messages,
            "max_output_tokens": max_tokens,
            "temperature": c.temperature if c.HasField("temperature") else 1.0,
            "top_p": c.top_p if c.HasField("top_p") else 1.0,
            "stop": list(c.stop),
            "seed": c.seed if c.HasField("seed") else None,
        }

    def _image(self, req: gateway_pb2.SubmitTaskRequest, task_type: str, bad: list[tuple[str, str]]) -> str | None:
        """The sha256 naming the request's image, or None (with the reason in `bad` when one was due or wrong)."""
        if task_type != "image-to-video":
            if req.HasField("image"):
                bad.append(("image", f"task_type {task_type} takes no image; use image-to-video"))
            return None
        if not req.HasField("image"):
            bad.append(("image", f"task_type {task_type} needs an input image"))
            return None
        source = req.image.WhichOneof("source")
        if source == "data":
            if not req.image.data.startswith(_IMAGE_SIGNATURES) and req.image.data[8:12] != b"WEBP":
                bad.append(("image.data", "is not an image in an allowed format (PNG, JPEG, WEBP)"))
                return None
            return hashlib.sha256(req.image.data).hexdigest()
        if source == "url":
            if not req.image.url.startswith("https://"):
                bad.append(("image.url", "may not be fetched: only https URLs are"))
                return None
            return hashlib.sha256(req.image.url.encode()).hexdigest()
        if source == "upload_sha256":
            if req.image.upload_sha256 not in self._uploads:
                bad.append(("image.upload_sha256", "names no input image of this tenant (never uploaded, or expired)"))
                return None
            return req.image.upload_sha256
        bad.append(("image", "needs one of data, url or upload_sha256"))
        return None

    def _attached(self, message: task_pb2.ChatMessage, i: int, bad: list[tuple[str, str]]) -> str:
        """A chat message's content with the text upload it names appended (after a blank line), as the gateway does."""
        if not message.content_sha256:
            return message.content
        text = self._texts.get(message.content_sha256)
        if text is None:
            bad.append(
                (
                    f"chat.messages[{i}].content_sha256",
                    "names no text attachment of this tenant (never uploaded, or expired)",
                )
            )
            return message.content
        return f"{message.content}\n\n{text}" if message.content else text
