"""Reasoning models' thoughts: `<think>…</think>` (or the family's markers) split from the answer.

A parser is named as vLLM's `--reasoning-parser` names it. Text arrives in arbitrary pieces (a
marker may be split across tokens, or across stream chunks), so `ReasoningStream` holds back only
what could still be the start of a marker and says, piece by piece, which text is thought and which
is answer; the unary split runs the same stream over the whole text, so both agree.

Where the thoughts begin: after the start marker at the output's start (leading blanks allowed),
or at once when the rendered prompt already opened them (DeepSeek-R1's template ends its prompt with
`<think>`; `deepseek_r1` assumes so in any case, as vLLM does). A prompt that closed them (Qwen3 with
`enable_thinking: false` writes an empty `<think></think>`) means no thoughts. Thoughts cut short
(by a length limit) are still thoughts: the answer is then empty.

With a grammar in force (structured output, tools), `grammar_after_thoughts` lets the thoughts run
free and constrains what follows them (llguidance's lazy `stop=` lexeme ends the free text at the
end marker).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from inference_service.config import REASONING_PARSERS
from inference_service.errors import ValidationError
from inference_service.frontend.text_markers import held_back
from inference_service.sample.grammar_spec import GrammarSpec, grammar_spec_from_tgi, lark_json


@dataclass(frozen=True)
class ReasoningSyntax:
    """How one family writes its thoughts."""

    name: str
    start: str
    end: str
    implicit_start: bool = False  # the output starts inside the thoughts without writing `start`


THINK_TAGS = ReasoningSyntax("qwen3", "<think>", "</think>")
SYNTAXES = {
    "deepseek_r1": ReasoningSyntax("deepseek_r1", "<think>", "</think>", implicit_start=True),
    "qwen3": THINK_TAGS,
    "glm45": ReasoningSyntax("glm45", "<think>", "</think>"),
    "mistral": ReasoningSyntax("mistral", "[THINK]", "[/THINK]"),
    "seed_oss": ReasoningSyntax("seed_oss", "<seed:think>", "</seed:think>"),
}
assert set(SYNTAXES) | {"none"} == set(REASONING_PARSERS), "config.REASONING_PARSERS names every syntax"


def reasoning_syntax(name: str | None, template: Any) -> ReasoningSyntax | None:
    """The `--reasoning-parser` named (None: chosen from the chat template; "none": no split)."""
    if name is None:
        return THINK_TAGS if "<think>" in _template_text(template) or "</think>" in _template_text(template) else None
    if name == "none":
        return None
    return SYNTAXES[name]


def _template_text(template: Any) -> str:
    if isinstance(template, dict):
        return "\n".join(str(text) for text in template.values())
    return template or ""


def prompt_closed(syntax: ReasoningSyntax, prompt: str) -> bool:
    """The rendered prompt ends with closed thoughts (Qwen3's `enable_thinking: false`): none are expected."""
    return prompt.rstrip().endswith(syntax.end)


def starts_inside(syntax: ReasoningSyntax, prompt: str) -> bool:
    """Whether generation begins inside the thoughts, judged by how the rendered prompt ends."""
    if prompt_closed(syntax, prompt):
        return False
    return syntax.implicit_start or prompt.rstrip().endswith(syntax.start)


class ReasoningStream:
    """`feed(text)` → [("reasoning" | "content", text)]; `finish()` → what was held back.

    Blanks between the start marker and the thoughts, and between the end marker and the answer,
    are dropped (templates put a line break there)."""

    def __init__(self, syntax: ReasoningSyntax, inside: bool = False):
        self.syntax = syntax
        self._inside = inside
        self._state = "start"  # start → opening (blanks) → thinking → after (blanks) → answer; or start → answer
        self._buffer = ""
        self.thought = False  # a thought was seen (even an empty one)

    def feed(self, text: str) -> list[tuple[str, str]]:
        self._buffer += text
        items: list[tuple[str, str]] = []
        while self._buffer:
            before = (self._state, len(self._buffer))
            getattr(self, f"_{self._state}")(items)
            if (self._state, len(self._buffer)) == before:
                break  # waiting for more text
        return [item for item in items if item[1]]

    def finish(self) -> list[tuple[str, str]]:
        thinking = self._state in ("opening", "thinking") or (self._state == "start" and self._inside)
        kind = "reasoning" if thinking else "content"
        rest, self._buffer = self._buffer, ""
        if self._state == "start" and not self._inside and rest.strip() and self.syntax.start.startswith(rest.strip()):
            kind = "content"  # a lone partial marker at the end is text
        return [(kind, rest)] if rest and (kind == "content" or rest.strip()) else []

    def _start(self, items: list) -> None:
        stripped = self._buffer.lstrip()
        if not stripped or (self.syntax.start.startswith(stripped) and stripped != self.syntax.start):
            return  # blanks, or the start marker so far
        if stripped.startswith(self.syntax.start):
            self._buffer = stripped[len(self.syntax.start) :]
            self._state, self.thought = "opening", True
        elif self._inside:
            self._buffer = stripped
            self._state, self.thought = "thinking", True
        else:
            self._state = "answer"

    def _opening(self, items: list) -> None:
        self._buffer = self._buffer.lstrip()
        if self._buffer:
            self._state = "thinking"

    def _thinking(self, items: list) -> None:
        end = self._buffer.find(self.syntax.end)
        if end >= 0:
            items.append(("reasoning", self._buffer[:end]))
            self._buffer, self._state = self._buffer[end + len(self.syntax.end) :], "after"
            return
        keep = held_back(self._buffer, (self.syntax.end,))
        items.append(("reasoning", self._buffer[: len(self._buffer) - keep]))
        self._buffer = self._buffer[len(self._buffer) - keep :]

    def _after(self, items: list) -> None:
        self._buffer = self._buffer.lstrip()
        if self._buffer:
            self._state = "answer"

    def _answer(self, items: list) -> None:
        items.append(("content", self._buffer))
        self._buffer = ""


def split_reasoning(syntax: ReasoningSyntax, inside: bool, text: str) -> tuple[str | None, str]:
    """(thoughts or None when there were none, answer) of a whole output."""
    stream = ReasoningStream(syntax, inside)
    items = stream.feed(text) + stream.finish()
    reasoning = "".join(piece for kind, piece in items if kind == "reasoning")
    content = "".join(piece for kind, piece in items if kind == "content")
    return (reasoning if stream.thought else None), content


def grammar_after_thoughts(grammar: Any, syntax: ReasoningSyntax, inside: bool) -> GrammarSpec:
    """A grammar (TGI's dict or a GrammarSpec) that first lets the model think freely: an optional
    thought (a required one when the prompt opened it), then the original grammar. A regex that
    writes the thoughts itself (it begins with the start marker) is kept as it is."""
    spec = grammar if isinstance(grammar, GrammarSpec) else grammar_spec_from_tgi(grammar)
    if spec.kind == "regex" and spec.value.startswith((syntax.start, re.escape(syntax.start))):
        return spec
    if spec.kind == "json":
        rules = [f"answer: {lark_json(json.loads(spec.value))}"]
    elif spec.kind == "regex":
        rules = [f"answer: /{_slashes_escaped(spec.value)}/"]
    else:
        if not spec.value.lstrip().startswith("start:"):
            raise ValidationError("grammar is not valid: with reasoning, a lark grammar must begin with its start rule")
        rules = ["answer:" + spec.value.lstrip()[len("start:") :]]
    opening = "" if inside else f"{json.dumps(syntax.start)} "
    thought = f"thought: {opening}thought_text /[ \\n]*/"
    text = f"thought_text[stop={json.dumps(syntax.end)}]: /(?s:.*)/"
    start = "start: thought answer" if inside else "start: thought? answer"
    return GrammarSpec(kind="lark", value="\n".join([start, thought, text, *rules]))


def _slashes_escaped(pattern: str) -> str:
    """A regex written between Lark's slashes: its unescaped `/` escaped."""
    out, escaped = [], False
    for char in pattern:
        out.append("\\/" if char == "/" and not escaped else char)
        escaped = char == "\\" and not escaped
    return "".join(out)
