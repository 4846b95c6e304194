"""A small YAML writer for Envoy configs: block style, strings quoted as JSON (valid YAML), and
multi-line strings (the Lua filter) as literal blocks so the written config stays readable.

Deterministic, with no dependency: the committed `deploy/envoy/envoy.yaml` is compared byte for
byte with a fresh rendering.
"""

from __future__ import annotations

import json
import re
from typing import Any

_PLAIN_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*\Z")
_PLAIN_STRING = re.compile(r"[A-Za-z_/][A-Za-z0-9_./-]*\Z")
_YAML_WORDS = {"true", "false", "null", "yes", "no", "on", "off", "y", "n"}
INDENT = "  "


def _scalar(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return json.dumps(value)
    if isinstance(value, str):
        plain = _PLAIN_STRING.match(value) and value.lower() not in _YAML_WORDS
        return value if plain else json.dumps(value, ensure_ascii=False)
    raise TypeError(f"cannot write {type(value).__name__} as YAML")


def _key(key: str) -> str:
    return key if _PLAIN_KEY.match(key) else json.dumps(key)


def _is_block_text(value: Any) -> bool:
    return isinstance(value, str) and "\n" in value and not value.startswith((" ", "\n"))


def _block_text(text: str, depth: int) -> list[str]:
    indicator = "|" if text.endswith("\n") and not text.endswith("\n\n") else "|-"
    pad = INDENT * depth
    body = [pad + line if line else "" for line in text.rstrip("\n").split("\n")]
    return [indicator, *body]


def _lines(value: Any, depth: int) -> list[str]:
    pad = INDENT * depth
    if isinstance(value, dict):
        if not value:
            return [pad + "{}"]
        lines = []
        for key, item in value.items():
            lines.extend(_entry(pad + _key(key) + ":", item, depth))
        return lines
    if isinstance(value, list):
        if not value:
            return [pad + "[]"]
        lines = []
        for item in value:
            nested = _lines(item, depth + 1)
            if isinstance(item, dict | list) and item:
                lines.append(pad + "- " + nested[0].lstrip())
                lines.extend(nested[1:])
            else:
                lines.extend(_entry(pad + "-", item, depth))
        return lines
    return [pad + _scalar(value)]


def _entry(head: str, item: Any, depth: int) -> list[str]:
    """`key:` or `-` followed by a value, inline when it is a scalar."""
    if _is_block_text(item):
        indicator, *body = _block_text(item, depth + 1)
        return [f"{head} {indicator}", *body]
    if isinstance(item, dict | list) and item:
        return [head, *_lines(item, depth + 1)]
    return [f"{head} {_lines(item, 0)[0]}"]


def dump(value: dict[str, Any]) -> str:
    return "\n".join(_lines(value, 0)) + "\n"
