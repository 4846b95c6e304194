"""One tool call's JSON object (`{"name": ..., "arguments": ...}`), read a character at a time: the
name once its string is complete, the arguments' text as it arrives, so a stream can announce a call
and send its arguments before the object ends."""

from __future__ import annotations

import json


class JsonValue:
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


class CallObject:
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
        self._value: JsonValue | None = None

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
            self._value, self._key = JsonValue(), self._key if self._expect == "value" else None
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
            self._value = JsonValue()
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
