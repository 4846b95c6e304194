"""The OpenAPI 3 document of the REST API, generated from the proto: its HTTP rules give the routes,
its messages the schemas (with their comments as descriptions), and the gateway's shaping rules
(`gateway.contract`, `gateway/tgi.lua`) what the JSON looks like on the wire.

What the Lua filter changes, the schemas say: 64-bit integers are numbers, floats may be null (a
NaN logprob), `top_tokens` is a list of lists, a route's `response_body` is unwrapped, TGI's errors
are `{"error", "error_type"}` and OpenAI's `{"error": {...}}`, streams are SSE events of one
message each. OpenAPI 3.0 (what the bundled Swagger UI reads), so null is `nullable`.

`make protos` writes it to `protos/textgen/openapi.json` (committed, checked fresh by a test); the
server answers it at `GET /openapi.json` and Swagger UI at `GET /docs`.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

from google.protobuf import descriptor_pb2

from gateway.contract import SERVICE, RestRoute, load_descriptor_set, rest_routes

FD = descriptor_pb2.FieldDescriptorProto
OUTPUT = Path(__file__).resolve().parent.parent / "protos" / "textgen" / "openapi.json"
_INTEGERS = {
    FD.TYPE_INT32: "int32",
    FD.TYPE_SINT32: "int32",
    FD.TYPE_SFIXED32: "int32",
    FD.TYPE_UINT32: "int32",
    FD.TYPE_FIXED32: "int32",
    FD.TYPE_INT64: "int64",
    FD.TYPE_SINT64: "int64",
    FD.TYPE_SFIXED64: "int64",
    FD.TYPE_UINT64: "int64",
    FD.TYPE_FIXED64: "int64",
}
# Messages whose JSON is not an object of their fields.
_SPECIAL = {
    ".google.protobuf.Value": {"description": "Any JSON value."},
    ".google.protobuf.Struct": {"type": "object", "additionalProperties": True},
    ".google.protobuf.ListValue": {"type": "array", "items": {}},
    ".google.api.HttpBody": {"type": "string"},
}
# Repeated Values whose entries have one known shape or null (the legacy logprobs of an echoed prompt).
_VALUE_ITEMS = {
    ".textgen.v1.CompletionLogprobs.token_logprobs": {"type": "number", "nullable": True},
    ".textgen.v1.CompletionLogprobs.top_logprobs": {
        "type": "object",
        "additionalProperties": {"type": "number"},
        "nullable": True,
    },
}
# The Lua filter prints each TopTokens as the plain list of its tokens (TGI's list of lists).
_FLATTENED = {".textgen.v1.TopTokens": "tokens"}
TGI_ERRORS = {
    "400": "The body is not JSON this route reads (TGI: a syntax error)",
    "401": "Missing or wrong API key (--api-key)",
    "413": "Payload too large",
    "422": "Input validation error",
    "424": "Generation error",
    "429": "Model is overloaded",
    "503": "The model is loading, the server is draining, or it is unreachable",
}
# What the raw (HttpBody) routes answer, by RPC.
RAW_CONTENT = {
    "Metrics": {"text/plain": {"schema": {"type": "string"}}},
    "OpenApi": {"application/json": {"schema": {"type": "object"}}},
    "Docs": {
        media: {"schema": {"type": "string"}}
        for media in ("text/html", "application/javascript", "text/css", "image/png")
    },
}
# Routes the Lua filter sends to a stream RPC when the body says `"stream": true` (same path).
STREAMED_BY_BODY = {
    "/": "GenerateStream",
    "/invocations": "GenerateStream",
    "/v1/chat/completions": "ChatCompletionStream",
    "/v1/completions": "CompletionStream",
    "/v1/messages": "MessagesStream",
    "/v1/responses": "CreateResponseStream",
}
OPENAI_ERRORS = {
    "400": "Invalid request",
    "401": "Missing or wrong API key (--api-key)",
    "404": "No such model",
    "422": "Chat template or tool error",
    "429": "Model is overloaded",
    "500": "Generation error",
    "503": "The server is unavailable",
}

ANTHROPIC_ERRORS = {
    "400": "Invalid request (invalid_request_error)",
    "401": "Missing or wrong API key: `x-api-key` or `Authorization: Bearer` (--api-key)",
    "413": "Request too large",
    "429": "Model is overloaded (rate_limit_error)",
    "500": "Generation error (api_error)",
    "503": "The server is unavailable (overloaded_error)",
}


class _Comments:
    """Leading comments of messages, fields and methods, from the descriptor's source info."""

    def __init__(self, file: descriptor_pb2.FileDescriptorProto):
        self.by_path = {
            tuple(loc.path): loc.leading_comments.strip()
            for loc in file.source_code_info.location
            if loc.leading_comments.strip()
        }

    def get(self, *path: int) -> str | None:
        text = self.by_path.get(path)
        return " ".join(line.strip() for line in text.splitlines()) if text else None


def _messages(descriptor_set: descriptor_pb2.FileDescriptorSet) -> dict[str, tuple]:
    """{".pkg.Name": (message proto, comments, its source path)} for every message, nested ones too."""
    found: dict[str, tuple] = {}

    def walk(prefix: str, message, comments: _Comments, path: tuple[int, ...]) -> None:
        name = f"{prefix}.{message.name}"
        found[name] = (message, comments, path)
        for index, nested in enumerate(message.nested_type):
            walk(name, nested, comments, (*path, 3, index))

    for file in descriptor_set.file:
        comments = _Comments(file)
        for index, message in enumerate(file.message_type):
            walk(f".{file.package}", message, comments, (4, index))
    return found


class _Schemas:
    """Component schemas, added as routes reference them."""

    def __init__(self, descriptor_set: descriptor_pb2.FileDescriptorSet):
        self.messages = _messages(descriptor_set)
        self.components: dict[str, Any] = {}

    def ref(self, type_name: str) -> dict[str, Any]:
        if type_name in _SPECIAL:
            return dict(_SPECIAL[type_name])
        if type_name in _FLATTENED:
            message = self.messages[type_name][0]
            field = next(f for f in message.field if f.name == _FLATTENED[type_name])
            return self._field(field, None)
        name = type_name.rsplit(".", 1)[1]
        if name not in self.components:
            self.components[name] = {}  # reserved first: messages may refer to themselves
            self.components[name] = self._object(type_name)
        return {"$ref": f"#/components/schemas/{name}"}

    def _object(self, type_name: str) -> dict[str, Any]:
        message, comments, path = self.messages[type_name]
        properties = {}
        for index, field in enumerate(message.field):
            properties[field.name] = self._field(field, comments.get(*path, 2, index))
            if f"{type_name}.{field.name}" in _VALUE_ITEMS:
                properties[field.name]["items"] = dict(_VALUE_ITEMS[f"{type_name}.{field.name}"])
        schema: dict[str, Any] = {"type": "object", "properties": properties}
        if comments.get(*path):
            schema["description"] = comments.get(*path)
        return schema

    def _field(self, field, description: str | None) -> dict[str, Any]:
        message = self.messages.get(field.type_name)
        if message is not None and message[0].options.map_entry:
            value = next(f for f in message[0].field if f.name == "value")
            schema: dict[str, Any] = {"type": "object", "additionalProperties": self._field(value, None)}
        else:
            schema = self._single(field)
            if field.label == FD.LABEL_REPEATED:
                schema = {"type": "array", "items": schema}
        if "$ref" in schema and field.label != FD.LABEL_REPEATED:
            schema = {"allOf": [schema], "nullable": True}  # an unset message prints as null (or is left out)
        elif field.proto3_optional:
            schema["nullable"] = True  # TGI prints some unset optional fields as null
        if description:
            schema = (
                {**schema, "description": description}
                if "$ref" not in schema
                else {"allOf": [schema], "description": description}
            )
        return schema

    def _single(self, field) -> dict[str, Any]:
        if field.type in _INTEGERS:
            return {"type": "integer", "format": _INTEGERS[field.type]}
        if field.type in (FD.TYPE_FLOAT, FD.TYPE_DOUBLE):
            return {"type": "number", "nullable": True}  # NaN and infinities are printed as null
        if field.type == FD.TYPE_BOOL:
            return {"type": "boolean"}
        if field.type == FD.TYPE_STRING:
            return {"type": "string"}
        if field.type == FD.TYPE_BYTES:
            return {"type": "string", "format": "byte"}
        if field.type == FD.TYPE_ENUM:
            return {"type": "string"}
        return self.ref(field.type_name)

    def unwrapped(self, type_name: str, field_name: str) -> dict[str, Any]:
        message = self.messages[type_name][0]
        return self._field(next(f for f in message.field if f.name == field_name), None)


def _error_schemas() -> dict[str, Any]:
    return {
        "ErrorResponse": {
            "type": "object",
            "required": ["error", "error_type"],
            "properties": {"error": {"type": "string"}, "error_type": {"type": "string"}},
        },
        "AnthropicErrorResponse": {
            "type": "object",
            "required": ["type", "error"],
            "properties": {
                "type": {"type": "string", "enum": ["error"]},
                "error": {
                    "type": "object",
                    "required": ["type", "message"],
                    "properties": {"type": {"type": "string"}, "message": {"type": "string"}},
                },
            },
        },
        "OpenAIErrorResponse": {
            "type": "object",
            "required": ["error"],
            "properties": {
                "error": {
                    "type": "object",
                    "required": ["message", "type"],
                    "properties": {
                        "message": {"type": "string"},
                        "type": {"type": "string"},
                        "param": {"type": "string", "nullable": True},
                        "code": {"type": "string", "nullable": True},
                    },
                }
            },
        },
    }


def _openapi_path(route: RestRoute) -> tuple[str, list[dict[str, Any]]]:
    """`/v1/models/{id=**}` → `/v1/models/{id}` and its path parameters."""
    names = re.findall(r"\{(\w+)(?:=[^}]*)?\}", route.path)
    path = re.sub(r"\{(\w+)(?:=[^}]*)?\}", r"{\1}", route.path)
    return path, [{"name": name, "in": "path", "required": True, "schema": {"type": "string"}} for name in names]


def _operation(
    route: RestRoute, method, comments: str | None, schemas: _Schemas, stream_outputs: dict[str, str]
) -> dict[str, Any]:
    openai = route.kind.startswith("openai") or route.path.startswith("/v1/")
    tag = "Anthropic" if route.kind.startswith("anthropic") else ("OpenAI" if openai else "TGI")
    operation: dict[str, Any] = {"tags": [tag], "summary": route.rpc}
    if comments:
        operation["description"] = comments
    path, parameters = _openapi_path(route)
    if parameters:
        operation["parameters"] = parameters
    if route.method == "POST":
        operation["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": schemas.ref(method.input_type)}},
        }
    operation["responses"] = _responses(route, method, schemas, openai, stream_outputs)
    return operation


def _responses(
    route: RestRoute, method, schemas: _Schemas, openai: bool, stream_outputs: dict[str, str]
) -> dict[str, Any]:
    if route.kind == "health":
        return {
            "200": {"description": "Ready to generate (an empty body)"},
            "503": {
                "description": "Not ready",
                "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}},
            },
        }
    if route.kind == "raw":
        responses = {"200": {"description": "OK", "content": RAW_CONTENT[route.rpc]}}
        if route.rpc == "Docs":
            responses["404"] = {
                "description": "No such file",
                "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}},
            }
        return responses
    schema = schemas.unwrapped(method.output_type, route.unwrap) if route.unwrap else schemas.ref(method.output_type)
    anthropic = route.kind.startswith("anthropic")
    if route.streams and anthropic:
        ok = {
            "description": "Server-sent events: each an `event:` line naming the event's `type` and a `data:` line, "
            "one JSON object of this schema; errors arrive as an `error` event",
            "content": {"text/event-stream": {"schema": schema}},
        }
    elif route.streams:
        ok = {
            "description": "Server-sent events, each `data:` line one JSON object of this schema"
            + (", ending with `data: [DONE]`" if openai else "; errors arrive as a last event"),
            "content": {"text/event-stream": {"schema": schema}},
        }
    else:
        ok = {"description": "OK", "content": {"application/json": {"schema": schema}}}
        if route.path in STREAMED_BY_BODY:  # `"stream": true`: the stream RPC's events
            ok["description"] = 'OK; with `"stream": true` in the body, server-sent events of the stream route'
            ok["content"]["text/event-stream"] = {"schema": schemas.ref(stream_outputs[STREAMED_BY_BODY[route.path]])}
    errors = ANTHROPIC_ERRORS if anthropic else (OPENAI_ERRORS if openai else TGI_ERRORS)
    error_name = "AnthropicErrorResponse" if anthropic else ("OpenAIErrorResponse" if openai else "ErrorResponse")
    error_schema = {"$ref": f"#/components/schemas/{error_name}"}
    responses = {"200": ok}
    for status, description in errors.items():
        responses[status] = {"description": description, "content": {"application/json": {"schema": error_schema}}}
    return responses


def document(descriptor_set: descriptor_pb2.FileDescriptorSet | None = None) -> dict[str, Any]:
    descriptor_set = descriptor_set or load_descriptor_set()
    package, _, service_name = SERVICE.rpartition(".")
    file = next(
        f for f in descriptor_set.file if f.package == package and any(s.name == service_name for s in f.service)
    )
    service_index = next(i for i, s in enumerate(file.service) if s.name == service_name)
    service, comments = file.service[service_index], _Comments(file)
    methods = {m.name: (index, m) for index, m in enumerate(service.method)}
    schemas = _Schemas(descriptor_set)
    paths: dict[str, dict[str, Any]] = {}
    seen: dict[str, int] = {}
    for route in rest_routes(descriptor_set):
        index, method = methods[route.rpc]
        operation = _operation(
            route,
            method,
            comments.get(6, service_index, 2, index),
            schemas,
            {name: m.output_type for name, (_, m) in methods.items()},
        )
        seen[route.rpc] = seen.get(route.rpc, 0) + 1
        operation["operationId"] = route.rpc if seen[route.rpc] == 1 else f"{route.rpc}_{seen[route.rpc]}"
        paths.setdefault(_openapi_path(route)[0], {})[route.method.lower()] = operation
    return {
        "openapi": "3.0.3",
        "info": {
            "title": "inference-service REST API",
            "description": "TGI's, OpenAI's and Anthropic's REST routes, served by Envoy in front of the gRPC API "
            "(textgen.v1.TextGeneration). Generated from the proto.",
            "version": "1",
        },
        "paths": paths,
        "components": {"schemas": {**schemas.components, **_error_schemas()}},
    }


def render(descriptor_set: descriptor_pb2.FileDescriptorSet | None = None) -> str:
    return json.dumps(document(descriptor_set), indent=1, sort_keys=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gateway.openapi", description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, default=OUTPUT)
    args = parser.parse_args(argv)
    args.output.write_text(render(), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
