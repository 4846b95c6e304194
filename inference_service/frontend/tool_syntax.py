"""How each model family writes its tool calls (vLLM's `--tool-call-parser` names), and which one a
chat template writes: the parsers (`tool_parsers`) read calls back by it, and the tool grammar
(`openai_tools.combined_grammar`) makes the model write them by it, so with a known format the model
writes calls as it was trained to, and they always parse.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from inference_service.config import TOOL_CALL_PARSERS


@dataclass(frozen=True)
class ToolSyntax:
    """How calls are written: around the whole list, around each call, between calls; and the key
    holding the arguments. `text_start` is a regex class of what plain text may not begin with."""

    name: str
    list_open: str = ""
    list_close: str = ""
    call_open: str = ""
    call_close: str = ""
    separator: str = "\n"
    arguments_key: str = "arguments"
    not_text_start: str = "{"


SYNTAXES = {
    "json": ToolSyntax("json"),
    "hermes": ToolSyntax("hermes", call_open="<tool_call>\n", call_close="\n</tool_call>", not_text_start="<"),
    "llama3_json": ToolSyntax("llama3_json", separator="; ", arguments_key="parameters"),
    "mistral": ToolSyntax("mistral", list_open="[TOOL_CALLS][", list_close="]", separator=", ", not_text_start="["),
}
assert set(SYNTAXES) | {"none"} == set(TOOL_CALL_PARSERS), "config.TOOL_CALL_PARSERS names every syntax"


def tool_syntax(name: str | None, template: Any) -> ToolSyntax:
    """The `--tool-call-parser` named (None: the one the chat template writes; "none": ours)."""
    if name is None:
        text = "\n".join(str(t) for t in template.values()) if isinstance(template, dict) else (template or "")
        if "<tool_call>" in text:
            return SYNTAXES["hermes"]
        if "<|python_tag|>" in text:
            return SYNTAXES["llama3_json"]
        if "[TOOL_CALLS]" in text:
            return SYNTAXES["mistral"]
        return SYNTAXES["json"]
    return SYNTAXES["json" if name == "none" else name]
