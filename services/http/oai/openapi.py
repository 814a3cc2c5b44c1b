"""The OpenAI face's part of the OpenAPI document: its paths under /openai/v1 and the shapes it answers with (the
subset of OpenAI's objects it fills; the official client reads these fields)."""

from __future__ import annotations

from typing import Any

from .routes import PREFIX

_STR = {"type": "string"}
_INT = {"type": "integer"}
_NULL_INT = {"type": ["integer", "null"]}
_NULL_STR = {"type": ["string", "null"]}
_META = {"type": ["object", "null"], "additionalProperties": {"type": "string"}, "maxProperties": 16}


def _ref(name: str) -> dict[str, Any]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _list(item: str) -> dict[str, Any]:
    return {"type": "object", "required": ["object", "data", "has_more"], "properties": {
        "object": {"const": "list"}, "data": {"type": "array", "items": _ref(item)}, "first_id": _NULL_STR,
        "last_id": _NULL_STR, "has_more": {"type": "boolean"}}}


COMPONENTS: dict[str, Any] = {
    "OpenAIError": {
        "type": "object",
        "required": ["error"],
        "properties": {
            "error": {
                "type": "object",
                "required": ["message", "type", "param", "code"],
                "properties": {"message": _STR, "type": _STR, "param": _NULL_STR, "code": _NULL_STR},
            }
        },
    },
    "OpenAIResponse": {
        "type": "object",
        "required": ["id", "object", "created_at", "status", "model", "output"],
        "properties": {
            "id": {"type": "string", "pattern": "^resp_[0-9]+$"},
            "object": {"const": "response"},
            "created_at": _INT,
            "status": {"enum": ["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"]},
            "background": {"type": "boolean"},
            "model": _STR,
            "output": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "id": _STR,
                        "type": {"const": "message"},
                        "role": {"const": "assistant"},
                        "status": _STR,
                        "content": {
                            "type": "array",
                            "items": {"type": "object", "properties": {"type": {"const": "output_text"}, "text": _STR}},
                        },
                    },
                },
            },
            "error": {"type": ["object", "null"], "properties": {"code": _STR, "message": _STR}},
            "incomplete_details": {"type": ["object", "null"], "properties": {"reason": _STR}},
            "instructions": _NULL_STR,
            "metadata": _META,
            "max_output_tokens": _NULL_INT,
            "temperature": {"type": ["number", "null"]},
            "top_p": {"type": ["number", "null"]},
            "usage": {
                "type": ["object", "null"],
                "properties": {"input_tokens": _INT, "output_tokens": _INT, "total_tokens": _INT},
            },
            "completed_at": _NULL_INT,
        },
    },
    "OpenAIResponseCreate": {
        "type": "object",
        "required": ["model", "input", "background"],
        "properties": {
            "model": _STR,
            "background": {"const": True, "description": "required: responses run in background mode only"},
            "input": {
                "oneOf": [
                    _STR,
                    {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "properties": {
                                "role": {"enum": ["user", "assistant", "system", "developer"]},
                                "content": {},
                            },
                        },
                    },
                ]
            },
            "instructions": _STR,
            "max_output_tokens": _INT,
            "temperature": {"type": "number"},
            "top_p": {"type": "number"},
            "metadata": _META,
            "store": {"const": True},
            "stream": {"type": "boolean"},
            "user": _STR,
            "safety_identifier": {"type": "string", "description": "the end user the task is for"},
        },
    },
    "OpenAIFile": {
        "type": "object",
        "required": ["id", "object", "bytes", "created_at", "filename", "purpose"],
        "properties": {
            "id": {"type": "string", "pattern": "^file-[0-9]+$"},
            "object": {"const": "file"},
            "bytes": _INT,
            "created_at": _INT,
            "filename": _STR,
            "purpose": {"enum": ["batch", "batch_output", "batch_error"]},
            "status": _STR,
        },
    },
    "OpenAIBatch": {
        "type": "object",
        "required": ["id", "object", "endpoint", "input_file_id", "completion_window", "status"],
        "properties": {
            "id": {"type": "string", "pattern": "^batch_[0-9]+$"},
            "object": {"const": "batch"},
            "endpoint": {"enum": ["/v1/responses", "/v1/chat/completions"]},
            "input_file_id": _STR,
            "completion_window": _STR,
            "status": {
                "enum": [
                    "validating",
                    "in_progress",
                    "finalizing",
                    "completed",
                    "failed",
                    "expired",
                    "cancelling",
                    "cancelled",
                ]
            },
            "output_file_id": _NULL_STR,
            "error_file_id": _NULL_STR,
            "created_at": _INT,
            **{
                name: _NULL_INT
                for name in (
                    "in_progress_at",
                    "expires_at",
                    "finalizing_at",
                    "completed_at",
                    "failed_at",
                    "expired_at",
                    "cancelling_at",
                    "cancelled_at",
                )
            },
            "request_counts": {"type": "object", "properties": {"total": _INT, "completed": _INT, "failed": _INT}},
            "metadata": _META,
            "errors": {"type": ["object", "null"]},
        },
    },
    "OpenAIBatchCreate": {
        "type": "object",
        "required": ["input_file_id", "endpoint", "completion_window"],
        "properties": {
            "input_file_id": _STR,
            "endpoint": {"enum": ["/v1/responses", "/v1/chat/completions"]},
            "completion_window": {"type": "string", "description": "TASKGATE_OPENAI_WINDOWS (1h, 24h)"},
            "metadata": _META,
            "user": {"type": "string", "description": "every line's end user"},
        },
    },
    "OpenAIModel": {
        "type": "object",
        "required": ["id", "object"],
        "properties": {"id": _STR, "object": {"const": "model"}, "created": _INT, "owned_by": _STR},
    },
    "OpenAIFileList": _list("OpenAIFile"),
    "OpenAIBatchList": _list("OpenAIBatch"),
    "OpenAIModelList": _list("OpenAIModel"),
}

_ERRORS = {"default": _json(_ref("OpenAIError"), "an error in OpenAI's shape (Retry-After on 429 and 503)")}
_TAG = ["openai"]


def _op(op_id: str, summary: str, answer: dict[str, Any], *, params: list[dict[str, Any]] | None = None,
        body: dict[str, Any] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"operationId": op_id, "summary": summary, "tags": _TAG, "security": [{"bearer": []}],
                           "responses": {"200": answer, **_ERRORS}}
    if params:
        out["parameters"] = params
    if body:
        out["requestBody"] = body
    return out


def _path(name: str) -> dict[str, Any]:
    return {"name": name, "in": "path", "required": True, "schema": _STR}


def _query(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "in": "query", "required": False, "schema": schema}


PATHS: dict[str, Any] = {
    f"{PREFIX}/models": {"get": _op("OpenAIListModels", "the model entries", _json(_ref("OpenAIModelList"), "models"))},
    f"{PREFIX}/models/{{model}}": {
        "get": _op(
            "OpenAIGetModel", "one model entry", _json(_ref("OpenAIModel"), "the model"), params=[_path("model")]
        )
    },
    f"{PREFIX}/responses": {
        "post": _op(
            "OpenAICreateResponse",
            "a background response: a chat task (background=true required; stream=true streams it)",
            {
                **_json(_ref("OpenAIResponse"), "the response, queued"),
                "content": {
                    "application/json": {"schema": _ref("OpenAIResponse")},
                    "text/event-stream": {"schema": _STR},
                },
            },
            body={"required": True, "content": {"application/json": {"schema": _ref("OpenAIResponseCreate")}}},
        )
    },
    f"{PREFIX}/responses/{{response_id}}": {
        "get": _op(
            "OpenAIGetResponse",
            "a response; stream=true: its events, after starting_after",
            {
                **_json(_ref("OpenAIResponse"), "the response"),
                "content": {
                    "application/json": {"schema": _ref("OpenAIResponse")},
                    "text/event-stream": {"schema": _STR},
                },
            },
            params=[_path("response_id"), _query("stream", {"type": "boolean"}), _query("starting_after", _INT)],
        )
    },
    f"{PREFIX}/responses/{{response_id}}/cancel": {
        "post": _op(
            "OpenAICancelResponse",
            "stops a response (its task hard-cancelled)",
            _json(_ref("OpenAIResponse"), "cancelled"),
            params=[_path("response_id")],
        )
    },
    f"{PREFIX}/files": {
        "post": _op(
            "OpenAIUploadFile",
            "a batch's JSONL input (multipart: file, purpose=batch)",
            _json(_ref("OpenAIFile"), "the stored file"),
            body={
                "required": True,
                "content": {
                    "multipart/form-data": {
                        "schema": {
                            "type": "object",
                            "required": ["file", "purpose"],
                            "properties": {
                                "file": {"type": "string", "contentEncoding": "binary"},
                                "purpose": {"const": "batch"},
                            },
                        }
                    }
                },
            },
        ),
        "get": _op(
            "OpenAIListFiles",
            "the caller's files, newest first",
            _json(_ref("OpenAIFileList"), "a page"),
            params=[_query("purpose", _STR), _query("limit", _INT), _query("after", _STR)],
        ),
    },
    f"{PREFIX}/files/{{file_id}}": {
        "get": _op("OpenAIGetFile", "one file", _json(_ref("OpenAIFile"), "the file"), params=[_path("file_id")])
    },
    f"{PREFIX}/files/{{file_id}}/content": {
        "get": _op(
            "OpenAIGetFileContent",
            "a file's bytes (a batch's output and error files as OpenAI's result lines)",
            {"description": "JSONL", "content": {"application/jsonl": {"schema": _STR}}},
            params=[_path("file_id")],
        )
    },
    f"{PREFIX}/batches": {
        "post": _op(
            "OpenAICreateBatch",
            "a batch: each line of the input file one task",
            _json(_ref("OpenAIBatch"), "the batch, validating"),
            body={"required": True, "content": {"application/json": {"schema": _ref("OpenAIBatchCreate")}}},
        ),
        "get": _op(
            "OpenAIListBatches",
            "the caller's batches, newest first",
            _json(_ref("OpenAIBatchList"), "a page"),
            params=[_query("limit", _INT), _query("after", _STR)],
        ),
    },
    f"{PREFIX}/batches/{{batch_id}}": {
        "get": _op(
            "OpenAIGetBatch",
            "a batch, its counts from its tasks",
            _json(_ref("OpenAIBatch"), "the batch"),
            params=[_path("batch_id")],
        )
    },
    f"{PREFIX}/batches/{{batch_id}}/cancel": {
        "post": _op(
            "OpenAICancelBatch",
            "stops the ingest and cancels the unfinished tasks",
            _json(_ref("OpenAIBatch"), "cancelling"),
            params=[_path("batch_id")],
        )
    },
}
