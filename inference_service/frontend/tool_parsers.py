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

Each `ToolSyntax` also says how the tool grammar (`openai_tools.combined_grammar`) writes calls, so
with a known format the model writes calls as it was trained to, and they always parse.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from inference_service.config import TOOL_CALL_PARSERS
from inference_service.frontend.text_markers import held_back


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


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


# -- one call's JSON object, read a character at a time ------------------------------------------
class _Value:
    """One JSON value's text, read a character at a time until it ends."""

    def __init__(self) -> None:
        self.text = ""
        self.done = False
        self._depth = 0
        self._in_string = self._escaped = False

    def read(self, char: str) -> bool:
        """Whether `char` belongs to the value (a literal ends at the first character after it)."""
        if not self.text:
            self.text = char
            self._in_string, self._depth = char == '"', int(char in "{[")
            return True
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif char == "\\":
                self._escaped = True
            elif char == '"':
                self._in_string = False
                self.done = self._depth == 0
            self.text += char
            return True
        if self._depth == 0:  # a number, true, false or null
            if char in ",}] \n\t\r":
                self.done = True
                return False
            self.text += char
            return True
        if char == '"':
            self._in_string = True
        elif char in "{[":
            self._depth += 1
        elif char in "}]":
            self._depth -= 1
            self.done = self._depth == 0
        self.text += char
        return True


class _CallObject:
    """`{"name": ..., "arguments": ...}` (either key order, any spacing; Llama's `parameters`): the
    name once its string is complete, the arguments' text as it arrives."""

    ARGUMENT_KEYS = ("arguments", "parameters")

    def __init__(self) -> None:
        self.raw = ""
        self.name: str | None = None
        self.arguments: str | None = None
        self.complete = False
        self.arguments_started = False
        self._opened = False
        self._expect = "key"  # key → colon → value → next
        self._key: str | None = None
        self._value: _Value | None = None

    def read(self, char: str) -> str:
        """Reads one character; returns what it adds to the arguments' text (maybe "")."""
        self.raw += char
        if self._value is not None:
            value = self._value
            if value.read(char):
                streamed = self._key in self.ARGUMENT_KEYS and not value.text.startswith('"')
                if value.done:
                    self._end_value()
                return char if streamed else ""
            self._end_value()  # a literal ended: this character is the object's
        if not self._opened:
            self._opened = char == "{"
        elif char == '"':
            self._value, self._key = _Value(), self._key if self._expect == "value" else None
            self._value.read(char)
            self.arguments_started = self.arguments_started or self._key in self.ARGUMENT_KEYS
        elif char == ":" and self._expect == "colon":
            self._expect = "value"
        elif char == ",":
            self._expect = "key"
        elif char == "}":
            self.complete = True
        elif self._expect == "value" and char not in " \n\t\r":
            self.arguments_started = self.arguments_started or self._key in self.ARGUMENT_KEYS
            self._value = _Value()
            self._value.read(char)
            if self._value.done:
                self._end_value()
            return char if self._key in self.ARGUMENT_KEYS else ""
        return ""

    def _end_value(self) -> None:
        value, self._value = self._value, None
        assert value is not None
        if self._expect == "key":  # that string was a key
            self._key, self._expect = json.loads(value.text), "colon"
            return
        self._expect = "next"
        if self._key == "name" and value.text.startswith('"'):
            self.name = json.loads(value.text)
        elif self._key in self.ARGUMENT_KEYS:
            self.arguments = value.text

    def late_arguments(self) -> str:
        """Arguments written as a JSON string (some models quote them): the text they hold, once read."""
        if self.arguments is not None and self.arguments.startswith('"'):
            try:
                return str(json.loads(self.arguments))
            except json.JSONDecodeError:
                return ""
        return ""

    def arguments_json(self) -> str | None:
        """The arguments as JSON text, "{}" when absent; None when they are not JSON."""
        text = self.late_arguments() or (self.arguments or "").strip() or "{}"
        try:
            json.loads(text)
        except json.JSONDecodeError:
            return None
        return text


# -- the parsers --------------------------------------------------------------------------------
@dataclass
class _Call:
    index: int
    id: str
    reader: _CallObject
    announced: bool = False
    pending: str = ""  # arguments read before the name
    late_sent: bool = False  # arguments given as a JSON string were sent


@dataclass
class ToolParser:
    """Shared machinery: calls read through `_CallObject`s, and the items they give."""

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
        self.calls.append(_Call(len(self.calls), new_call_id(), _CallObject()))
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
