"""An OpenAI batch's files as the gateway's (see services/http/oai/routes.py): each input line translated into a
submission or the error that keeps it from being one, each output line back into OpenAI's shape."""

from __future__ import annotations

import json
from typing import Any

from google.protobuf import json_format
from google.rpc import status_pb2

from taskgate.config import HttpSettings
from taskgate_api.v1 import task_pb2

from . import errors, shapes


def translate_input(data: bytes, endpoint: str, window_seconds: float, settings: HttpSettings) -> bytes:
    """An OpenAI batch input (JSONL of {custom_id, method, url, body}) as the gateway's: each line a submission
    (its priority and queue TTL from the completion window) or the error that keeps it from being one."""
    priority = task_pb2.PRIORITY_NORMAL if window_seconds <= 3600 else task_pb2.PRIORITY_LOW
    translate = shapes.response_request if endpoint == "/v1/responses" else shapes.chat_request
    out: list[bytes] = []
    seen: set[str] = set()
    for number, raw in enumerate(line for line in data.split(b"\n") if line.strip()):
        custom_id = f"line-{number + 1}"
        try:
            try:
                line = json.loads(raw)
            except ValueError as exc:
                raise shapes.Refused("", f"line {number + 1} is not JSON: {exc}", "invalid_json") from None
            if not isinstance(line, dict):
                raise shapes.Refused("", f"line {number + 1} is not a JSON object", "invalid_json")
            if isinstance(line.get("custom_id"), str) and line["custom_id"]:
                custom_id = line["custom_id"]
            else:
                raise shapes.Refused("custom_id", f"line {number + 1} has no custom_id", "missing_required_parameter")
            if custom_id in seen:
                raise shapes.Refused(
                    "custom_id", f"custom_id {custom_id!r} is not unique in the file", "duplicate_custom_id"
                )
            seen.add(custom_id)
            if line.get("method", "POST") != "POST" or line.get("url") != endpoint:
                raise shapes.Refused(
                    "url", f"line {number + 1} must be a POST to the batch's endpoint {endpoint}", "invalid_url"
                )
            body = line.get("body")
            if not isinstance(body, dict):
                raise shapes.Refused("body", f"line {number + 1} has no body object", "missing_required_parameter")
            req = translate(body, settings)
            req.priority = priority
            req.max_queue_seconds = window_seconds
            out.append(json.dumps({"custom_id": custom_id, "request": json_format.MessageToDict(req)}).encode())
        except shapes.Refused as refused:
            error = {
                "code": refused.code,
                "message": refused.message,
                "param": refused.param or None,
                "line": number + 1,
            }
            out.append(json.dumps({"custom_id": custom_id, "error": error}).encode())
    return b"\n".join(out) + b"\n"


def result_line(line: dict[str, Any], endpoint: str) -> dict[str, Any]:
    """One line of a batch's output or error file in OpenAI's shape: the response body of a task, or the error."""
    custom_id = line.get("custom_id")
    if "task" in line:
        task = json_format.ParseDict(line["task"], task_pb2.Task(), ignore_unknown_fields=True)
        request_id = f"batch_req_{task.id}"
        if task.status == task_pb2.TASK_STATUS_SUCCEEDED:
            text = line.get("text")
            body = shapes.response(task, text) if endpoint == "/v1/responses" else shapes.chat_completion(task, text)
            return {"id": request_id, "custom_id": custom_id,
                    "response": {"status_code": 200, "request_id": task.id, "body": body}, "error": None}
        if task.error_code == "QUEUE_TTL_EXPIRED":
            error = {"code": "batch_expired",
                     "message": "This request could not be executed before the completion window expired."}
        elif task.status == task_pb2.TASK_STATUS_CANCELED:
            error = {"code": "batch_cancelled", "message": "This request was cancelled with its batch."}
        else:
            error = {"code": (task.error_code or "failed").lower(), "message": task.error_message or "the task failed"}
        return {"id": request_id, "custom_id": custom_id, "response": None, "error": error}
    error = line.get("error") or {}
    if isinstance(error.get("code"), int):  # the gateway refused the line: its status as the HTTP answer it would be
        status = json_format.ParseDict(error, status_pb2.Status(), ignore_unknown_fields=True)
        refusal = errors.of_proto(status)
        return {
            "id": f"batch_req_{custom_id}",
            "custom_id": custom_id,
            "response": {"status_code": refusal.pop("status_code"), "request_id": "", "body": refusal},
            "error": None,
        }
    return {"id": f"batch_req_{custom_id}", "custom_id": custom_id, "response": None,
            "error": {"code": error.get("code"), "message": error.get("message")}}
