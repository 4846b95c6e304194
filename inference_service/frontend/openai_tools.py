"""OpenAI tool calling: the grammar a call must follow.

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
list). `tool_parsers` reads calls back, in every format (the JSON lines above included).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from inference_service.errors import ECHO_CHARS, ToolError, quoted, shortened
from inference_service.frontend.tool_syntax import SYNTAXES, ToolSyntax
from inference_service.sample.grammar_spec import GrammarSpec, lark_json

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
