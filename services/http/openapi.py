"""The OpenAPI 3.1 document of the HTTP API (served at /openapi.json).

The schemas are made from the .proto messages themselves (their descriptors, in the proto3 JSON mapping with the
.proto field names), so they cannot drift from what the routes send; the paths are written out here.
"""

from __future__ import annotations

import functools
from typing import Any

from google.protobuf.descriptor import Descriptor, EnumDescriptor, FieldDescriptor

from taskgate_api.v1 import gateway_pb2, task_pb2

from .oai import openapi as openai_face

_SCALARS: dict[int, dict[str, Any]] = {
    FieldDescriptor.TYPE_DOUBLE: {"type": "number"},
    FieldDescriptor.TYPE_FLOAT: {"type": "number"},
    FieldDescriptor.TYPE_INT32: {"type": "integer", "format": "int32"},
    FieldDescriptor.TYPE_SINT32: {"type": "integer", "format": "int32"},
    FieldDescriptor.TYPE_UINT32: {"type": "integer", "format": "int32"},
    FieldDescriptor.TYPE_FIXED32: {"type": "integer"},
    FieldDescriptor.TYPE_SFIXED32: {"type": "integer"},
    # proto3 JSON writes 64-bit integers as strings (and accepts numbers)
    FieldDescriptor.TYPE_INT64: {"type": ["string", "integer"], "pattern": "^-?[0-9]+$", "format": "int64"},
    FieldDescriptor.TYPE_SINT64: {"type": ["string", "integer"], "pattern": "^-?[0-9]+$", "format": "int64"},
    FieldDescriptor.TYPE_UINT64: {"type": ["string", "integer"], "pattern": "^[0-9]+$", "format": "uint64"},
    FieldDescriptor.TYPE_FIXED64: {"type": ["string", "integer"], "pattern": "^[0-9]+$"},
    FieldDescriptor.TYPE_SFIXED64: {"type": ["string", "integer"], "pattern": "^-?[0-9]+$"},
    FieldDescriptor.TYPE_BOOL: {"type": "boolean"},
    FieldDescriptor.TYPE_STRING: {"type": "string"},
    FieldDescriptor.TYPE_BYTES: {"type": "string", "contentEncoding": "base64"},
}
_WELL_KNOWN: dict[str, dict[str, Any]] = {
    "google.protobuf.Timestamp": {"type": "string", "format": "date-time"},
    "google.protobuf.Duration": {"type": "string", "pattern": "^-?[0-9]+(\\.[0-9]+)?s$"},
    "google.protobuf.Any": {"type": "object", "properties": {"@type": {"type": "string"}}, "required": ["@type"]},
}


def _name(full_name: str) -> str:
    return full_name.removeprefix("taskgate.v1.").replace(".", "_")


def _enum(enum: EnumDescriptor) -> dict[str, Any]:
    return {"type": "string", "enum": [v.name for v in enum.values]}


def _field(field: FieldDescriptor, found: dict[str, Descriptor]) -> dict[str, Any]:
    message = field.message_type
    if message is not None:
        if message.GetOptions().map_entry:
            return {"type": "object", "additionalProperties": _field(message.fields_by_name["value"], found)}
        if message.full_name in _WELL_KNOWN:
            schema = dict(_WELL_KNOWN[message.full_name])
        else:
            found[message.full_name] = message
            schema = {"$ref": f"#/components/schemas/{_name(message.full_name)}"}
    elif field.enum_type is not None:
        schema = _enum(field.enum_type)
    else:
        schema = dict(_SCALARS[field.type])
    if field.is_repeated:  # (a map returned above)
        return {"type": "array", "items": schema}
    return schema


def _message(message: Descriptor, found: dict[str, Descriptor]) -> dict[str, Any]:
    properties = {f.name: _field(f, found) for f in message.fields}
    return {"type": "object", "properties": properties, "additionalProperties": False}


def schemas(roots: list[Descriptor]) -> dict[str, Any]:
    """JSON Schemas of `roots` and every message they reach, by component name."""
    found: dict[str, Descriptor] = {d.full_name: d for d in roots}
    out: dict[str, Any] = {}
    while len(out) < len(found):
        for full_name, descriptor in list(found.items()):
            if _name(full_name) not in out:
                out[_name(full_name)] = _message(descriptor, found)
    return out


def _ref(name: str) -> dict[str, Any]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["code", "status", "message", "details"],
            "properties": {
                "code": {"type": "integer", "description": "the HTTP status"},
                "status": {"type": "string", "description": "the gRPC status name, e.g. INVALID_ARGUMENT"},
                "message": {"type": "string"},
                "details": {"type": "array", "items": _WELL_KNOWN["google.protobuf.Any"],
                            "description": "google.rpc details: BadRequest field_violations, ErrorInfo reason, "
                            "RetryInfo"},
            },
        }
    },
}
_ERRORS = {
    "default": _json(_ref("Error"), "an error: the gRPC status in HTTP terms (Retry-After on 429 and 503)"),
}
_TASK_ID = {"name": "task_id", "in": "path", "required": True, "schema": {"type": "string", "pattern": "^[0-9]+$"}}
_AUTH: list[dict[str, list[str]]] = [{"bearer": []}]
_SSE = {"description": "a text/event-stream", "content": {"text/event-stream": {"schema": {"type": "string"}}}}


def _with_created(name: str) -> dict[str, Any]:
    return {"allOf": [_ref(name)], "properties": {"created": {"type": "boolean"}}}


@functools.cache
def document() -> dict[str, Any]:
    """The whole OpenAPI 3.1 document."""
    components = schemas(
        [
            gateway_pb2.SubmitTaskRequest.DESCRIPTOR,
            gateway_pb2.SubmitTaskResponse.DESCRIPTOR,
            gateway_pb2.SubmitTasksRequest.DESCRIPTOR,
            gateway_pb2.GetTaskResponse.DESCRIPTOR,
            gateway_pb2.CancelTaskRequest.DESCRIPTOR,
            gateway_pb2.CancelTaskResponse.DESCRIPTOR,
            gateway_pb2.RegenerateTaskRequest.DESCRIPTOR,
            gateway_pb2.RegenerateTaskResponse.DESCRIPTOR,
            gateway_pb2.UploadInputResponse.DESCRIPTOR,
            task_pb2.TaskEvent.DESCRIPTOR,
            task_pb2.OutputChunk.DESCRIPTOR,
            task_pb2.TaskProgress.DESCRIPTOR,
            gateway_pb2.TaskGatewayRotateWebhookSecretRequest.DESCRIPTOR,
            gateway_pb2.TaskGatewayRotateWebhookSecretResponse.DESCRIPTOR,
            gateway_pb2.CreateClientTokenRequest.DESCRIPTOR,
            gateway_pb2.CreateClientTokenResponse.DESCRIPTOR,
            gateway_pb2.GetClientTokenSecretRequest.DESCRIPTOR,
            gateway_pb2.GetClientTokenSecretResponse.DESCRIPTOR,
        ]
    )
    # answers with `created` beside the message's own fields
    for name in ("SubmitTaskResponse", "RegenerateTaskResponse"):
        components[name]["properties"]["created"] = {"type": "boolean"}
    components["Error"] = ERROR
    components.update(openai_face.COMPONENTS)
    components["ListTasksResponse"] = {
        "type": "object", "additionalProperties": False,
        "properties": {"tasks": {"type": "array", "items": _ref("Task")}, "next_page_token": {"type": "string"}},
    }
    components["SubmitTasksResponse"] = {
        "type": "object", "additionalProperties": False,
        "properties": {"results": {"type": "array", "items": {
            "oneOf": [
                {"type": "object", "required": ["response"], "properties": {"response": _ref("SubmitTaskResponse")},
                 "additionalProperties": False},
                _ref("Error"),
            ],
        }}},
    }
    components["Snapshot"] = {"type": "object", "required": ["task"], "properties": {"task": _ref("Task")}}
    idempotency = {"name": "Idempotency-Key", "in": "header", "required": False, "schema": {"type": "string"},
                   "description": "the submission's idempotency key (wins over none in the body; must equal one there)"}
    statuses = {"name": "status", "in": "query", "required": False, "explode": True,
                "schema": {"type": "array", "items": {"type": "string"}},
                "description": "task statuses (SUCCEEDED or TASK_STATUS_SUCCEEDED; repeat or comma-separate)"}
    paths: dict[str, Any] = {
        "/v1/tasks": {
            "post": {
                "operationId": "SubmitTask",
                "summary": "submit a task",
                "security": _AUTH,
                "parameters": [idempotency],
                "requestBody": {
                    "required": True,
                    "content": {"application/json": {"schema": _ref("SubmitTaskRequest")}},
                },
                "responses": {
                    "201": _json(_ref("SubmitTaskResponse"), "created"),
                    "200": _json(_ref("SubmitTaskResponse"), "an existing task for the idempotency key"),
                    **_ERRORS,
                },
            },
            "get": {
                "operationId": "ListTasks",
                "summary": "the caller's tasks, newest first",
                "security": _AUTH,
                "parameters": [
                    statuses,
                    {"name": "page_size", "in": "query", "schema": {"type": "integer"}},
                    {"name": "page_token", "in": "query", "schema": {"type": "string"}},
                    {"name": "created_after", "in": "query", "schema": {"type": "string", "format": "date-time"}},
                    {"name": "created_before", "in": "query", "schema": {"type": "string", "format": "date-time"}},
                ],
                "responses": {"200": _json(_ref("ListTasksResponse"), "a page"), **_ERRORS},
            },
        },
        "/v1/tasks:batch": {
            "post": {
                "operationId": "SubmitTasks",
                "summary": "up to 1,000 submissions, each with its own answer",
                "security": _AUTH,
                "requestBody": {
                    "required": True,
                    "content": {"application/json": {"schema": _ref("SubmitTasksRequest")}},
                },
                "responses": {"200": _json(_ref("SubmitTasksResponse"), "one result per request, in order"), **_ERRORS},
            }
        },
        "/v1/tasks/{task_id}": {
            "get": {
                "operationId": "GetTask",
                "summary": "a task, its queue position and ETA",
                "security": _AUTH,
                "parameters": [_TASK_ID],
                "responses": {
                    "200": {
                        **_json(_ref("GetTaskResponse"), "the task"),
                        "headers": {
                            "X-Suggested-Poll-Interval": {"schema": {"type": "string"}, "description": "seconds"}
                        },
                    },
                    **_ERRORS,
                },
            }
        },
        "/v1/tasks/{task_id}:cancel": {
            "post": {
                "operationId": "CancelTask",
                "summary": 'soft cancel, or {"hard": true}',
                "security": _AUTH,
                "parameters": [_TASK_ID],
                "requestBody": {
                    "required": False,
                    "content": {"application/json": {"schema": _ref("CancelTaskRequest")}},
                },
                "responses": {"200": _json(_ref("CancelTaskResponse"), "the task"), **_ERRORS},
            }
        },
        "/v1/tasks/{task_id}:regenerate": {
            "post": {
                "operationId": "RegenerateTask",
                "summary": "a new task from a finished one's request",
                "security": _AUTH,
                "parameters": [_TASK_ID, idempotency],
                "requestBody": {
                    "required": False,
                    "content": {"application/json": {"schema": _ref("RegenerateTaskRequest")}},
                },
                "responses": {
                    "201": _json(_ref("RegenerateTaskResponse"), "the new task"),
                    "200": _json(_ref("RegenerateTaskResponse"), "the task the key already named"),
                    **_ERRORS,
                },
            }
        },
        "/v1/tasks/{task_id}/result": {
            "get": {
                "operationId": "GetTaskResult",
                "summary": "the output (Range requests honoured)",
                "security": _AUTH,
                "parameters": [_TASK_ID, {"name": "Range", "in": "header", "schema": {"type": "string"}}],
                "responses": {
                    "200": {
                        "description": "the bytes, with Content-Type, Content-Length, Digest and ETag (sha256)",
                        "content": {"*/*": {"schema": {"type": "string", "contentEncoding": "binary"}}},
                    },
                    "206": {"description": "the requested range", "content": {"*/*": {"schema": {"type": "string"}}}},
                    "307": {"description": "a redirect to the output's presigned download URL (S3 result store)"},
                    "416": {"description": "a range outside the output"},
                    **_ERRORS,
                },
            }
        },
        "/v1/tasks/{task_id}/previews": {
            "get": {
                "operationId": "GetTaskPreview",
                "summary": "one preview image of a running (or ended) video",
                "security": _AUTH,
                "parameters": [
                    _TASK_ID,
                    {
                        "name": "uri",
                        "in": "query",
                        "required": True,
                        "schema": {"type": "string"},
                        "description": "the uri of one of the task's OUTPUT_KIND_PREVIEW output chunks",
                    },
                ],
                "responses": {
                    "200": {
                        "description": "the image (image/webp or image/png)",
                        "content": {"image/*": {"schema": {"type": "string", "contentEncoding": "binary"}}},
                    },
                    **_ERRORS,
                },
            }
        },
        "/v1/tasks/{task_id}/events": {
            "get": {
                "operationId": "WatchTask",
                "summary": "SSE: event `snapshot` (data: Snapshot), then `transition` (data: TaskEvent) and the task's "
                "partial output `output` (data: OutputChunk) in order; id = version, or version.sequence once "
                "output was sent; ends after the terminal one; resume both with Last-Event-ID. With progress=true, "
                "`progress` (data: TaskProgress) at each step while it runs, live and without an id (not resumed)",
                "security": _AUTH,
                "parameters": [
                    _TASK_ID,
                    {"name": "Last-Event-ID", "in": "header", "schema": {"type": "string"}},
                    {"name": "after_version", "in": "query", "schema": {"type": "integer"}},
                    {"name": "after_output_sequence", "in": "query", "schema": {"type": "integer"}},
                    {"name": "output", "in": "query", "schema": {"type": "boolean", "default": True}},
                    {"name": "progress", "in": "query", "schema": {"type": "boolean", "default": False}},
                ],
                "responses": {"200": _SSE, **_ERRORS},
            }
        },
        "/v1/events": {
            "get": {
                "operationId": "WatchTasks",
                "summary": "SSE: every event of the caller's tasks (`transition`, data: TaskEvent), id = cursor; "
                "resume with Last-Event-ID",
                "security": _AUTH,
                "parameters": [
                    statuses,
                    {"name": "Last-Event-ID", "in": "header", "schema": {"type": "string"}},
                    {"name": "cursor", "in": "query", "schema": {"type": "string"}},
                ],
                "responses": {"200": _SSE, **_ERRORS},
            }
        },
        "/v1/inputs": {
            "put": {
                "operationId": "UploadInput",
                "summary": "store an input image (the body: PNG, JPEG or WebP) or, with Content-Type text/plain, a "
                "chat text attachment (UTF-8) that a chat message names by content_sha256",
                "security": _AUTH,
                "requestBody": {
                    "required": True,
                    "content": {
                        "application/octet-stream": {"schema": {"type": "string"}},
                        "image/*": {"schema": {"type": "string"}},
                        "text/plain": {"schema": {"type": "string"}},
                    },
                },
                "responses": {
                    "201": _json(_ref("UploadInputResponse"), "the stored input: name it by sha256"),
                    **_ERRORS,
                },
            }
        },
        "/v1/webhook-secret:rotate": {
            "post": {
                "operationId": "RotateWebhookSecret",
                "summary": "a new webhook secret for the caller's tenant, shown once; the current ones keep signing "
                "until "
                'the overlap (default 24 h; "0s" retires them now) ends',
                "security": _AUTH,
                "requestBody": {
                    "required": False,
                    "content": {"application/json": {"schema": _ref("TaskGatewayRotateWebhookSecretRequest")}},
                },
                "responses": {
                    "200": _json(_ref("TaskGatewayRotateWebhookSecretResponse"), "the new secret"),
                    **_ERRORS,
                },
            }
        },
        "/v1/client-tokens": {
            "post": {
                "operationId": "CreateClientToken",
                "summary": "a short-lived token (at most 1 h) for one end user's tasks, which a browser or an app "
                "sends instead of the API key: GET a task and its result, its events (?access_token= on GET), "
                "cancel with the cancel scope",
                "security": _AUTH,
                "requestBody": {
                    "required": False,
                    "content": {"application/json": {"schema": _ref("CreateClientTokenRequest")}},
                },
                "responses": {"200": _json(_ref("CreateClientTokenResponse"), "the token"), **_ERRORS},
            }
        },
        "/v1/client-token-secret": {
            "post": {
                "operationId": "GetClientTokenSecret",
                "summary": "the tenant's client-token secret for minting tokens offline (the SDK's mint_client_token); "
                '{"rotate": true} makes a new one, the old one\'s tokens valid for the overlap',
                "security": _AUTH,
                "requestBody": {
                    "required": False,
                    "content": {"application/json": {"schema": _ref("GetClientTokenSecretRequest")}},
                },
                "responses": {"200": _json(_ref("GetClientTokenSecretResponse"), "the secret"), **_ERRORS},
            }
        },
    }
    paths.update(openai_face.PATHS)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "taskgate",
            "version": "v1",
            "description": "The TaskGateway and TaskEvents API as JSON over HTTP (proto3 JSON, .proto field names), "
            "and under /openai/v1 the OpenAI-compatible face (background responses, files, "
            "batches: docs/openai.md).",
        },
        "jsonSchemaDialect": "https://json-schema.org/draft/2020-12/schema",
        "components": {
            "schemas": components,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer", "description": "an API key"}},
        },
        "security": _AUTH,
        "paths": paths,
    }
