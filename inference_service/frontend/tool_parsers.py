"""Models' own tool-call formats, read back from their text (streamed or whole), by vLLM's names.

- `hermes` (Hermes, Qwen2.5/Qwen3): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
  one block a call, text before the first block is content;
- `llama3_json` (Llama 3.1-3.3): `<|python_tag|>` (optional) then `{"name": ..., "parameters": {...}}`,
  several separated by `;`; output that does not start with a call is content;
- `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (the marker is a special token that
  decoding may drop: a bare `[{"name"` at the start is read the same way);
- `json` (ours, the default): one `{"name": ..., "arguments": {...}}` a line, as the tool grammar writes.

Every parser reads pieces of text as they come (`feed`, then `finish`) and gives the items that
`ChatChoiceStream` turns into OpenAI's deltas: ("content", text), ("call", index, id, name) once a
call's name is complete, and ("arguments", index, piece) as its arguments arrive. Arguments are the
model's JSON text as written. `parse_tool_calls` runs the same parser over a whole text, so unary
and streamed results agree; a call cut short (a length limit) is not returned as a call.

The formats themselves are `tool_syntax.ToolSyntax`es (re-exported here for callers); one call's
JSON object is read by `tool_call_reader.CallObject`.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from inference_service.frontend.text_markers import held_back
from inference_service.frontend.tool_call_reader import CallObject
from inference_service.frontend.tool_syntax import SYNTAXES, ToolSyntax, tool_syntax

__all__ = ["SYNTAXES", "ToolParser", "ToolSyntax", "new_call_id", "parse_tool_calls", "tool_parser", "tool_syntax"]


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# -- the parsers --------------------------------------------------------------------------------
@dataclass
class _Call:
    index: int
    id: str
    reader: CallObject
    announced: bool = False
    pending: str = ""  # arguments read before the name
    late_sent: bool = False  # arguments given as a JSON string were sent


@dataclass
class ToolParser:
    """Shared machinery: calls read through `CallObject`s, and the items they give."""

    syntax: ToolSyntax
    names: frozenset[str] | None = None  # the offered functions; None: any name
    calls: list[_Call] = field(default_factory=list)
    _items: list[tuple] = field(default_factory=list)
    _buffer: str = ""

    @property
    def called(self) -> bool:
        return any(call.announced for call in self.calls)

    def feed(self, text: str) -> list[tuple]:
        self._buffer += text
        self._scan()
        items, self._items = self._items, []
        return _merged(items)

    def finish(self) -> list[tuple]:
        self._scan(final=True)
        items, self._items = self._items, []
        return _merged(items)

    def _scan(self, final: bool = False) -> None:  # each parser reads `_buffer` here
        raise NotImplementedError

    def _content(self, text: str) -> None:
        if text:
            self._items.append(("content", text))

    def _read_call(self, call: _Call) -> None:
        """Feed `_buffer` into `call` until its object completes (the rest stays in `_buffer`). The
        call is announced once its name is known and its arguments begin (or it completes), and only
        when the name is one of the offered functions."""
        reader, consumed = call.reader, 0
        for char in self._buffer:
            consumed += 1
            added = call.pending + reader.read(char)
            call.pending = ""
            if reader.arguments is not None and reader.arguments.startswith('"') and not call.late_sent:
                added, call.late_sent = reader.late_arguments(), True  # quoted arguments: sent whole
            ready = reader.name is not None and (reader.arguments_started or reader.complete)
            if not call.announced and ready and (self.names is None or reader.name in self.names):
                call.announced = True
                self._items.append(("call", call.index, call.id, reader.name))
            if call.announced:
                if reader.complete and reader.arguments is None:
                    added += "{}"
                if added:
                    self._items.append(("arguments", call.index, added))
            else:
                call.pending = added
            if reader.complete:
                break
        self._buffer = self._buffer[consumed:]

    def _new_call(self) -> _Call:
        self.calls.append(_Call(len(self.calls), new_call_id(), CallObject()))
        return self.calls[-1]

    def finished_calls(self) -> list[dict[str, Any]]:
        """The complete calls, as OpenAI's `tool_calls`."""
        calls = []
        for call in self.calls:
            arguments = call.reader.arguments_json() if call.reader.complete else None
            if call.announced and arguments is not None:
                function = {"name": call.reader.name, "arguments": arguments}
                calls.append({"id": call.id, "type": "function", "function": function})
        return calls


class HermesParser(ToolParser):
    """`<tool_call>{...}</tool_call>` blocks; text outside them is content (blanks between calls
    are dropped)."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self, syntax: ToolSyntax, names: frozenset[str] | None = None):
        super().__init__(syntax, names)
        self._state = "text"  # text → object → close → text

    def _scan(self, final: bool = False) -> None:
        while self._buffer:
            if self._state == "text":
                at = self._buffer.find(self.OPEN)
                if at < 0:
                    keep = 0 if final else held_back(self._buffer, (self.OPEN,))
                    cut = len(self._buffer) - keep
                    text, self._buffer = self._buffer[:cut], self._buffer[cut:]
                    self._content(text.strip() if self.calls else text)
                    return
                before = self._buffer[:at]
                self._content(before.strip() if self.calls else before)
                self._buffer, self._state = self._buffer[at + len(self.OPEN) :].lstrip(), "object"
                if self._buffer:
                    self._new_call()
                else:
                    self._state = "await"
            elif self._state == "await":
                self._buffer = self._buffer.lstrip()
                if self._buffer:
                    self._new_call()
                    self._state = "object"
            elif self._state == "object":
                self._read_call(self.calls[-1])
                if not self.calls[-1].reader.complete:
                    return
                self._state = "close"
            else:  # skip to the closing tag
                at = self._buffer.find(self.CLOSE)
                if at < 0:
                    keep = held_back(self._buffer, (self.CLOSE,))
                    self._buffer = self._buffer[len(self._buffer) - keep :] if not final else ""
                    return
                self._buffer, self._state = self._buffer[at + len(self.CLOSE) :], "text"


class JsonCallsParser(ToolParser):
    """Calls as bare JSON objects from the output's start (after `<|python_tag|>`, or inside
    Mistral's `[TOOL_CALLS][...]`), separated by `;`, `,` or line breaks; output that does not begin
    so is content."""

    MARKERS = ("<|python_tag|>", "[TOOL_CALLS]")

    def __init__(self, syntax: ToolSyntax, names: frozenset[str] | None = None):
        super().__init__(syntax, names)
        self._state = "start"  # start → between ⇄ object, or start → text

    def _scan(self, final: bool = False) -> None:
        while self._buffer:
            if self._state == "start":
                stripped = self._buffer.lstrip()
                if not final and any(m.startswith(stripped) and m != stripped for m in self.MARKERS):
                    return  # blanks or a marker so far
                for marker in self.MARKERS:
                    stripped = stripped.removeprefix(marker).lstrip()
                if self.syntax.name == "mistral" and stripped.startswith("["):
                    stripped = stripped[1:].lstrip()
                    if not stripped and not final:
                        return  # `[`: a list of calls, or text
                if not stripped and not final:
                    return
                if stripped.startswith("{"):
                    self._buffer, self._state = stripped, "between"
                else:
                    self._state = "text"
            elif self._state == "text":
                self._content(self._buffer)
                self._buffer = ""
            elif self._state == "between":
                self._buffer = self._buffer.lstrip(" \n\t;,]")
                if not self._buffer:
                    return
                if self._buffer[0] != "{":
                    self._state = "text"
                    continue
                self._new_call()
                self._state = "object"
            else:
                call = self.calls[-1]
                self._read_call(call)
                if not call.reader.complete:
                    return
                if not call.announced:  # JSON that is no call: it was text
                    self.calls.pop()
                    self._content(call.reader.raw)
                    self._state = "text"
                else:
                    self._state = "between"


PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser,
    "llama3_json": JsonCallsParser,
    "mistral": JsonCallsParser,
    "json": JsonCallsParser,
}


def tool_parser(syntax: ToolSyntax, names: Iterable[str] | None = None) -> ToolParser:
    """A fresh stream parser for one output; `names`: the functions a call may name."""
    return PARSERS[syntax.name](syntax, None if names is None else frozenset(names))


def parse_tool_calls(
    syntax: ToolSyntax, text: str, names: Iterable[str] | None = None
) -> tuple[str, list[dict[str, Any]]]:
    """(content, complete calls) of a whole output."""
    parser = tool_parser(syntax, names)
    items = parser.feed(text) + parser.finish()
    calls = parser.finished_calls()
    if not calls:
        return text, []  # no complete call: the text as written
    return "".join(item[1] for item in items if item[0] == "content"), calls


def _merged(items: list[tuple]) -> list[tuple]:
    """Adjacent pieces of the same kind (and call) as one: fewer, fuller deltas."""
    merged: list[tuple] = []
    for item in items:
        last = merged[-1] if merged else None
        if last and item[0] == last[0] == "content":
            merged[-1] = ("content", last[1] + item[1])
        elif last and item[0] == last[0] == "arguments" and item[1] == last[1]:
            merged[-1] = ("arguments", item[1], last[2] + item[2])
        else:
            merged.append(item)
    return merged
