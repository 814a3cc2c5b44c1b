"""OpenAI's object shapes made from taskgate's, and OpenAI request bodies read into taskgate requests.

A response is a chat task (`resp_<task id>`), a batch line a task of its batch; nothing here decides a rule: a
request is translated field by field, and the gateway's answer says whether it stands. What cannot be translated (a
tool, an image input, an unknown parameter) is refused naming the OpenAI parameter.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from google.protobuf.timestamp_pb2 import Timestamp

from taskgate.config import HttpSettings
from taskgate_api.v1 import batches_pb2, gateway_pb2, task_pb2

RESPONSE_PREFIX = "resp_"
MESSAGE_PREFIX = "msg_"
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
# OpenAI's response status by task status
STATUS = {
    task_pb2.TASK_STATUS_CREATED: "queued",
    task_pb2.TASK_STATUS_QUEUED: "queued",
    task_pb2.TASK_STATUS_PROCESSING: "in_progress",
    task_pb2.TASK_STATUS_SUCCEEDED: "completed",
    task_pb2.TASK_STATUS_FAILED: "failed",
    task_pb2.TASK_STATUS_TIMEOUT: "failed",
    task_pb2.TASK_STATUS_CANCELED: "cancelled",
}
TERMINAL = {task_pb2.TASK_STATUS_SUCCEEDED, task_pb2.TASK_STATUS_FAILED, task_pb2.TASK_STATUS_TIMEOUT,
            task_pb2.TASK_STATUS_CANCELED}
# body parameters a response create may carry that change nothing here (defaults OpenAI itself would apply)
_HARMLESS = {"parallel_tool_calls", "truncation", "include", "prompt_cache_key", "safety_identifier", "user",
             "service_tier", "reasoning", "top_logprobs", "stream_options"}
_RESPONSE_FIELDS = {"model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "metadata",
                    "background", "store", "stream", "tools", "tool_choice", "text"} | _HARMLESS
_CHAT_FIELDS = {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "stop", "seed",
                "metadata", "user", "n", "stream", "store", "safety_identifier", "service_tier"}


class Refused(ValueError):
    """A request the OpenAI face cannot translate: `param` names the OpenAI parameter at fault."""

    def __init__(self, param: str, message: str, code: str = "invalid_value", status: int = 400) -> None:
        super().__init__(message)
        self.param = param
        self.message = message
        self.code = code
        self.status = status


def seconds(ts: Timestamp) -> int | None:
    """A timestamp as OpenAI's integer Unix seconds; None when unset."""
    return int(ts.seconds) if ts.seconds or ts.nanos else None


def response_id(task_id: str) -> str:
    return f"{RESPONSE_PREFIX}{task_id}"


def task_id_of(text: str, prefix: str) -> str | None:
    """The task id inside an OpenAI-shaped id, or None when it is not one of ours."""
    rest = text.removeprefix(prefix)
    if rest == text or not rest.isascii() or not rest.isdigit() or len(rest) > 19:
        return None
    return rest


def model_of(body: dict[str, Any], settings: HttpSettings) -> str:
    """The model entry a request names (404 when there is none of that name)."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise Refused(
            "model",
            "required: the name of a model this gateway serves (GET /models lists them)",
            "missing_required_parameter",
        )
    if model not in settings.models:
        raise Refused("model", f"The model '{model}' does not exist.", "model_not_found", status=404)
    return model


def _text_of(content: Any, param: str) -> str:
    """A message's content as text: a string, or parts of type input_text/output_text/text."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts: list[str] = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
                raise Refused(
                    f"{param}[{i}]", "only text parts are supported (input_text, output_text)", "unsupported_value"
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise Refused(f"{param}[{i}].text", "must be a string")
            texts.append(text)
        return "".join(texts)
    raise Refused(param, "must be a string or a list of text parts")


def messages_of(items: Any, param: str) -> list[task_pb2.ChatMessage]:
    """A list of OpenAI messages (Responses input items of type message, or chat messages) as chat turns."""
    if isinstance(items, str):
        return [task_pb2.ChatMessage(role="user", content=items)]
    if not isinstance(items, list) or not items:
        raise Refused(param, "must be a string or a non-empty list of messages")
    out: list[task_pb2.ChatMessage] = []
    for i, item in enumerate(items):
        if not isinstance(item, dict) or item.get("type", "message") != "message":
            raise Refused(
                f"{param}[{i}]", "only messages are supported (no tool calls or other items)", "unsupported_value"
            )
        role = ROLES.get(str(item.get("role")))
        if role is None:
            raise Refused(f"{param}[{i}].role", "must be user, assistant, system or developer")
        out.append(task_pb2.ChatMessage(role=role, content=_text_of(item.get("content"), f"{param}[{i}].content")))
    return out


def _number(body: dict[str, Any], name: str, kind: type) -> Any:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
        raise Refused(name, f"must be {'a number' if kind is float else 'an integer'}")
    return kind(value)


def _metadata(body: dict[str, Any]) -> dict[str, str]:
    metadata = body.get("metadata")
    if metadata is None:
        return {}
    if not isinstance(metadata, dict) or len(metadata) > 16 or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise Refused("metadata", "must be an object of at most 16 string values")
    return dict(metadata)


def _end_user(body: dict[str, Any]) -> str:
    for name in ("safety_identifier", "user"):
        value = body.get(name)
        if value is not None:
            if not isinstance(value, str):
                raise Refused(name, "must be a string")
            return value
    return ""


def _unknown(body: dict[str, Any], known: set[str]) -> None:
    for name in body:
        if name not in known:
            raise Refused(name, "is not supported by this gateway", "unsupported_parameter")


def response_request(body: dict[str, Any], settings: HttpSettings) -> gateway_pb2.SubmitTaskRequest:
    """A Responses create body as a chat task submission."""
    _unknown(body, _RESPONSE_FIELDS)
    model = model_of(body, settings)
    if body.get("tools"):
        raise Refused("tools", "tools are not supported by this gateway", "unsupported_parameter")
    text = body.get("text")
    if text is not None and (
        not isinstance(text, dict) or (text.get("format") or {"type": "text"}).get("type") != "text"
    ):
        raise Refused("text.format", "only plain text output is supported", "unsupported_value")
    if body.get("input") is None:
        raise Refused("input", "required", "missing_required_parameter")
    messages = messages_of(body["input"], "input")
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise Refused("instructions", "must be a string")
        messages.insert(0, task_pb2.ChatMessage(role="system", content=instructions))
    chat = task_pb2.ChatParams(messages=messages)
    for name, kind in (("max_output_tokens", int), ("temperature", float), ("top_p", float)):
        value = _number(body, name, kind)
        if value is not None:
            setattr(chat, name, value)
    return gateway_pb2.SubmitTaskRequest(
        task_type="chat", model_id=model, chat=chat, metadata=_metadata(body), end_user=_end_user(body),
    )


def chat_request(body: dict[str, Any], settings: HttpSettings) -> gateway_pb2.SubmitTaskRequest:
    """A Chat Completions body (a batch line's) as a chat task submission."""
    _unknown(body, _CHAT_FIELDS)
    model = model_of(body, settings)
    if body.get("n") not in (None, 1):
        raise Refused("n", "only one choice per request is supported", "unsupported_value")
    chat = task_pb2.ChatParams(messages=messages_of(body.get("messages"), "messages"))
    tokens = _number(body, "max_completion_tokens", int)
    if tokens is None:
        tokens = _number(body, "max_tokens", int)
    if tokens is not None:
        chat.max_output_tokens = tokens
    for name, kind in (("temperature", float), ("top_p", float), ("seed", int)):
        value = _number(body, name, kind)
        if value is not None:
            setattr(chat, name, value)
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise Refused("stop", "must be a string or a list of strings")
        chat.stop.extend(stops)
    return gateway_pb2.SubmitTaskRequest(
        task_type="chat", model_id=model, chat=chat, metadata=_metadata(body), end_user=_end_user(body),
    )


@dataclass(frozen=True, slots=True)
class Answer:
    """A finished chat task's answer: its whole text (None until it succeeded) and why it ended."""

    text: str | None
    finish_reason: str


def answer_of(task: task_pb2.Task, full_text: str | None = None) -> Answer:
    if task.status != task_pb2.TASK_STATUS_SUCCEEDED:
        return Answer(None, "")
    text = full_text if full_text is not None else task.text.text
    return Answer(text, task.text.finish_reason or "stop")


def message_item(task: task_pb2.Task, text: str, status: str = "completed") -> dict[str, Any]:
    """The one output item of a response: the assistant's message."""
    return {
        "id": f"{MESSAGE_PREFIX}{task.id}",
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
        if status == "completed"
        else [],
    }


def usage_of(task: task_pb2.Task) -> dict[str, Any]:
    given, made = task.usage.input_tokens, task.usage.output_tokens
    return {
        "input_tokens": given, "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": made, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": given + made,
    }


def response(task: task_pb2.Task, full_text: str | None = None, *, instructions: str | None = None) -> dict[str, Any]:
    """A chat task as an OpenAI Response object (background mode)."""
    status = STATUS.get(task.status, "queued")
    answer = answer_of(task, full_text)
    output: list[dict[str, Any]] = []
    incomplete = None
    if answer.text is not None:
        output = [message_item(task, answer.text)]
        if answer.finish_reason == "length":
            status, incomplete = "incomplete", {"reason": "max_output_tokens"}
    error = None
    if task.status in (task_pb2.TASK_STATUS_FAILED, task_pb2.TASK_STATUS_TIMEOUT):
        error = {"code": "server_error", "message": f"{task.error_code}: {task.error_message}".strip(": ")}
    metadata = {k: v for k, v in task.metadata.items()}
    chat = task.chat
    return {
        "id": response_id(task.id), "object": "response", "created_at": seconds(task.created_at) or 0,
        "status": status, "background": True, "model": task.model_id, "output": output,
        "error": error, "incomplete_details": incomplete, "instructions": instructions, "metadata": metadata,
        "max_output_tokens": chat.max_output_tokens if chat.HasField("max_output_tokens") else None,
        "temperature": chat.temperature if chat.HasField("temperature") else None,
        "top_p": chat.top_p if chat.HasField("top_p") else None,
        "parallel_tool_calls": False, "tool_choice": "none", "tools": [], "store": True,
        "text": {"format": {"type": "text"}}, "truncation": "disabled",
        "usage": usage_of(task) if task.status in TERMINAL else None,
        "completed_at": seconds(task.finished_at) if task.status == task_pb2.TASK_STATUS_SUCCEEDED else None,
        "user": task.end_user or None,
    }


def chat_completion(task: task_pb2.Task, full_text: str | None = None) -> dict[str, Any]:
    """A SUCCEEDED chat task as an OpenAI ChatCompletion object (a batch output line's body)."""
    answer = answer_of(task, full_text)
    given, made = task.usage.input_tokens, task.usage.output_tokens
    return {
        "id": f"chatcmpl-{task.id}", "object": "chat.completion", "created": seconds(task.created_at) or 0,
        "model": task.model_id,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": answer.text or "", "refusal": None},
                     "finish_reason": answer.finish_reason or "stop", "logprobs": None}],
        "usage": {"prompt_tokens": given, "completion_tokens": made, "total_tokens": given + made},
    }


def file_object(stored: batches_pb2.StoredFile) -> dict[str, Any]:
    """A stored file as an OpenAI File object."""
    return {
        "id": stored.id, "object": "file", "bytes": stored.size_bytes, "created_at": seconds(stored.created_at) or 0,
        "filename": stored.filename, "purpose": stored.purpose, "status": "processed", "expires_at": None,
        "status_details": None,
    }


def batch_object(batch: batches_pb2.Batch) -> dict[str, Any]:
    """A batch as an OpenAI Batch object (the caller's own input file, not the translation the gateway ran)."""
    errors = None
    if batch.error_message:
        errors = {
            "object": "list",
            "data": [{"code": "invalid_input", "message": batch.error_message, "param": None, "line": None}],
        }
    counts = batch.counts
    return {
        "id": batch.id,
        "object": "batch",
        "endpoint": batch.endpoint,
        "errors": errors,
        "input_file_id": batch.source_file_id or batch.input_file_id,
        "completion_window": batch.completion_window,
        "status": batch.status,
        "output_file_id": batch.output_file_id or None,
        "error_file_id": batch.error_file_id or None,
        "created_at": seconds(batch.created_at) or 0,
        "in_progress_at": seconds(batch.in_progress_at),
        "expires_at": seconds(batch.expires_at),
        "finalizing_at": seconds(batch.finalizing_at),
        "completed_at": seconds(batch.completed_at),
        "failed_at": seconds(batch.failed_at),
        "expired_at": seconds(batch.completed_at) if batch.status == "expired" else None,
        "cancelling_at": seconds(batch.cancelling_at),
        "cancelled_at": seconds(batch.cancelled_at),
        "request_counts": {"total": counts.total, "completed": counts.completed, "failed": counts.failed},
        "metadata": dict(batch.metadata) or None,
    }


def now_seconds() -> int:
    return int(datetime.now().timestamp())
