"""OpenAI tool calling: the grammar a call must follow, and reading calls back from the text.

A call is written as one JSON line, `{"name": "<function>", "arguments": <arguments object>}`;
several calls (with `parallel_tool_calls`) are one a line. The grammar (a Lark grammar for the
grammar engine, the arguments as each function's JSON schema) makes that exact wrapper the only
way a call can start, so the text can be read back while it streams:
- `required` or a named function: the output is calls only;
- `auto`: the output is calls, or text that does not start with `{` (the response format's JSON
  when one is given);
- `none`, or no tools: no grammar from tools.
With a known native format (`--tool-call-parser`, `tool_parsers.ToolSyntax`) the grammar writes calls
in that format instead (Hermes' `<tool_call>` blocks, Llama's `parameters`, Mistral's `[TOOL_CALLS]`
list), and `tool_parsers` reads them back; `parse_tool_calls` and `ToolCallStream` here read only the
JSON-lines format.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from inference_service.errors import ECHO_CHARS, ToolError, quoted, shortened
from inference_service.frontend.tool_parsers import SYNTAXES, ToolSyntax
from inference_service.sample.grammar import GrammarSpec, lark_json

_CALL_HEAD = re.compile(r'\{"name": "((?:[^"\\]|\\.)*)", "arguments": ')
DEFAULT_SYNTAX = SYNTAXES["json"]


@dataclass(frozen=True)
class ToolCallFormat:
    """Which functions may be called, how many at once, and whether plain text is allowed."""

    schemas: dict[str, dict[str, Any]]  # function name -> its parameters' JSON schema
    parallel: bool
    text_allowed: bool


def tool_call_format(tools: list[dict[str, Any]], tool_choice: Any, parallel: bool) -> ToolCallFormat | None:
    """None when the output can't be a call (no tools, or `tool_choice` "none")."""
    schemas: dict[str, dict[str, Any]] = {}
    for tool in tools:
        function = tool.get("function") or {}
        name = function.get("name")
        if tool.get("type", "function") != "function" or not isinstance(name, str) or not name:
            raise ToolError('each tool must be {"type": "function", "function": {"name": ...}}')
        if name in schemas:
            raise ToolError(f"the function {quoted(name)} is defined twice")
        schemas[name] = function.get("parameters") or {"type": "object", "properties": {}}
    if tool_choice is None:
        tool_choice = "auto" if schemas else "none"
    if tool_choice == "none":
        return None
    if not schemas:
        raise ToolError("`tool_choice` needs `tools`")
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name")
        if tool_choice.get("type") != "function" or name not in schemas:
            given = shortened(json.dumps(tool_choice), ECHO_CHARS)
            raise ToolError(f"`tool_choice` names no defined function: {given}")
        return ToolCallFormat({name: schemas[name]}, parallel=False, text_allowed=False)
    if tool_choice not in ("auto", "required"):
        raise ToolError(f"`tool_choice` must be none, auto, required or a function, not {quoted(tool_choice)}")
    return ToolCallFormat(schemas, parallel=parallel, text_allowed=tool_choice == "auto")


def combined_grammar(
    calls: ToolCallFormat | None, response_grammar: dict[str, Any] | None, syntax: ToolSyntax = DEFAULT_SYNTAX
) -> Any:
    """The grammar of the whole output: TGI's grammar dict, a Lark GrammarSpec, or None. Calls are
    written in `syntax` (the model's own format when known, else one JSON object a line)."""
    if calls is None:
        return response_grammar
    separator = json.dumps(syntax.separator)
    rules = [f"calls: call ({separator} call)*" if calls.parallel else "calls: call"]
    if syntax.list_open or syntax.list_close:
        rules[0] = rules[0].replace("calls: ", f"calls: {json.dumps(syntax.list_open)} ", 1)
        rules[0] += f" {json.dumps(syntax.list_close)}"
    alternatives = []
    for i, (name, schema) in enumerate(sorted(calls.schemas.items())):
        head = json.dumps(f'{syntax.call_open}{{"name": {json.dumps(name)}, "{syntax.arguments_key}": ')
        alternatives.append(f"call{i}")
        rules.append(f"call{i}: {head} args{i} {json.dumps('}' + syntax.call_close)}")
        rules.append(f"args{i}: {lark_json(schema)}")
    rules.append("call: " + " | ".join(alternatives))
    start = "calls"
    if calls.text_allowed:
        if response_grammar is None:
            free_text = f"/[^{re.escape(syntax.not_text_start)}\\s][\\s\\S]*/"
            start, text_rule = "calls | TEXT", f"TEXT: {free_text}"
        elif response_grammar.get("type") in ("json", "json_object"):
            schema = response_grammar["value"]
            schema = json.loads(schema) if isinstance(schema, str) else schema
            start, text_rule = "calls | reply", f"reply: {lark_json(schema)}"
        else:
            raise ToolError("with tools, `response_format` can only be a JSON schema")
        rules.append(text_rule)
    return GrammarSpec(kind="lark", value="\n".join([f"start: {start}", *rules]))


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_tool_calls(text: str) -> list[dict[str, Any]] | None:
    """The calls written in `text` as OpenAI's tool_calls; None when it is not calls."""
    if not text.lstrip().startswith("{"):
        return None
    calls = []
    for line in text.strip().split("\n"):
        try:
            call = json.loads(line)
        except json.JSONDecodeError:
            return None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None
        calls.append(
            {
                "id": new_call_id(),
                "type": "function",
                "function": {
                    "name": call["name"],
                    "arguments": json.dumps(call.get("arguments", {}), ensure_ascii=False),
                },
            }
        )
    return calls


@dataclass
class ToolCallStream:
    """Reads streamed text into OpenAI's deltas: content, or tool-call header and argument pieces.

    `feed(text)` returns ("content", text) items, or ("call", index, id, name) when a call's name
    is complete and ("arguments", index, piece) for its arguments; the wrapper's `}` and the line
    breaks between calls are never part of the arguments.
    """

    mode: str | None = None  # None until the first non-blank character, then "content" or "calls"
    _buffer: str = ""
    _num_calls: int = 0
    _in_arguments: bool = False
    _started: bool = False  # the arguments' first character was read
    _depth: int = 0
    _in_string: bool = False
    _escaped: bool = False
    deltas: list[tuple] = field(default_factory=list)

    def feed(self, text: str) -> list[tuple]:
        self.deltas = []
        if self.mode is None:
            self._buffer += text
            stripped = self._buffer.lstrip()
            if not stripped:
                return []
            self.mode = "calls" if stripped.startswith("{") else "content"
            text, self._buffer = self._buffer, ""
        if self.mode == "content":
            return [("content", text)] if text else []
        for char in text:
            self._read(char)
        return self.deltas

    def _read(self, char: str) -> None:
        if not self._in_arguments:
            self._buffer += char
            match = _CALL_HEAD.search(self._buffer)
            if match:
                self.deltas.append(("call", self._num_calls, new_call_id(), json.loads(f'"{match.group(1)}"')))
                self._buffer, self._in_arguments, self._depth = "", True, 0
            return
        if self._depth == 0 and char in " \n}" and not self._in_string and self._started:
            self._in_arguments, self._started = False, False
            self._num_calls += 1
            return
        self._started = True
        self._track(char)
        self._append_argument(char)

    def _track(self, char: str) -> None:
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif char == "\\":
                self._escaped = True
            elif char == '"':
                self._in_string = False
        elif char == '"':
            self._in_string = True
        elif char in "{[":
            self._depth += 1
        elif char in "}]":
            self._depth -= 1

    def _append_argument(self, char: str) -> None:
        if self.deltas and self.deltas[-1][0] == "arguments" and self.deltas[-1][1] == self._num_calls:
            kind, index, piece = self.deltas[-1]
            self.deltas[-1] = (kind, index, piece + char)
        else:
            self.deltas.append(("arguments", self._num_calls, char))
