"""Protobuf `Value`/`Struct` fields as the plain JSON a caller wrote (schemas, tool arguments, stops)."""

from __future__ import annotations

from typing import Any

from google.protobuf import json_format


def plain_json(value: Any) -> Any:
    """A protobuf Value/Struct's content as the JSON a caller wrote, as far as it can be known.

    A Value holds every number as a double, so a schema's `"maxLength": 8` arrives as 8.0, which
    JSON-schema compilers refuse where an integer is required: whole numbers come back as ints. A
    Struct is a map, whose key order the protobuf runtime varies per process (on the client and
    here), so keys are sorted: the same request renders the same prompt and grammar on every server.
    """
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value)
    if isinstance(value, dict):
        return {key: plain_json(value[key]) for key in sorted(value)}
    if isinstance(value, list):
        return [plain_json(item) for item in value]
    return value


def value_to_python(value: Any) -> Any:
    """A google.protobuf.Value/Struct as plain Python (None when unset)."""
    return plain_json(json_format.MessageToDict(value)) if value.ByteSize() else None
