"""The fenced code blocks of the README and docs/*.md, and the rules that make them doc-tests.

Every block is one of:
- runnable: ```bash, ```sh or ```python; tests/e2e/test_readme.py runs it against a launched demo
  model, its ports (localhost:8080 REST and gRPC through Envoy, localhost:50051 gRPC direct,
  localhost:9000 metrics) rewritten to the test server's;
- skipped: a runnable block right after `<!-- not-tested: why -->`, the reason said in words;
- output: a ```text or ```json block right after `<!-- output -->`, what the runnable block just
  before it prints (text: exact, where `...` stands for any text, as doctest's ELLIPSIS; json: every
  key shown is there with a value of the same JSON type);
- text: ```text for what is neither code nor output (a diagram, a command's synopsis).
Anything else (no info string, another language) is an error, so that no block escapes the test.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNNABLE = ("bash", "sh", "python")
OUTPUT_LANGUAGES = ("text", "json")
# Commands that would make a ```text block code in disguise.
COMMAND_WORDS = ("curl", "grpcurl", "python", "pip", "make", ".venv/", "kubectl", "docker", "openssl", "$ ")

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
_COMMENT = re.compile(r"^\s*<!--\s*(?P<body>.*?)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    language: str
    code: str
    comment: str | None  # the HTML comment on the line right before the fence (blank lines allowed)

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path}:{self.line}"

    @property
    def skip_reason(self) -> str | None:
        if self.comment is None or not self.comment.startswith("not-tested"):
            return None
        return self.comment.removeprefix("not-tested").lstrip(":").strip()

    @property
    def is_output(self) -> bool:
        return self.comment == "output"


@dataclass(frozen=True)
class DocTest:
    block: Block
    output: Block | None  # what it prints, when the document shows it


def parse(path: Path, text: str | None = None) -> list[Block]:
    """Every fenced block of a Markdown file, in order."""
    lines = (path.read_text() if text is None else text).splitlines()
    blocks: list[Block] = []
    index = 0
    while index < len(lines):
        opening = _FENCE.match(lines[index])
        if opening is None:
            index += 1
            continue
        fence, indent = opening["fence"], len(opening["indent"])
        body: list[str] = []
        end = index + 1
        while end < len(lines):
            closing = _FENCE.match(lines[end])
            if closing and closing["fence"].startswith(fence) and not closing["info"].strip():
                break
            body.append(_dedent(lines[end], indent))
            end += 1
        info = opening["info"].strip().split()
        blocks.append(Block(path, index + 1, info[0] if info else "", "\n".join(body), _comment_before(lines, index)))
        index = end + 1
    return blocks


def _dedent(line: str, indent: int) -> str:
    """A line of a block indented (in a list item) by `indent`, without that indentation."""
    if line[:indent].isspace():
        return line[indent:]
    return line if indent == 0 else line.lstrip()


def _comment_before(lines: list[str], index: int) -> str | None:
    previous = index - 1
    while previous >= 0 and not lines[previous].strip():
        previous -= 1
    comment = _COMMENT.match(lines[previous]) if previous >= 0 else None
    return comment["body"] if comment else None


def doc_files(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def problems(blocks: list[Block]) -> list[str]:
    """What breaks the rules above, one line per block; empty when every block is tested or says why not."""
    found: list[str] = []
    for previous, block in zip([None, *blocks], blocks, strict=False):
        if block.is_output:
            if block.language not in OUTPUT_LANGUAGES:
                found.append(f"{block.where}: an output block is ```text or ```json, not {block.language!r}")
            elif previous is None or previous.language not in RUNNABLE or previous.is_output:
                found.append(f"{block.where}: output of no runnable block (put it right after the code)")
            elif previous.skip_reason is not None:
                found.append(f"{block.where}: output of a skipped block cannot be checked")
            elif block.language == "json":
                try:
                    json_values(block.code)
                except ValueError as error:
                    found.append(f"{block.where}: output is not JSON: {error}")
        elif block.language in RUNNABLE:
            reason = block.skip_reason
            if reason is not None and len(reason.split()) < 3:
                found.append(f"{block.where}: `not-tested` needs a reason in words, not {reason!r}")
            elif block.comment is not None and reason is None:
                found.append(f"{block.where}: unknown annotation {block.comment!r}")
        elif block.language == "text":
            first = block.code.lstrip().split("\n", 1)[0]
            if first.startswith(COMMAND_WORDS):
                found.append(f"{block.where}: a command in a ```text block: make it ```bash (run or not-tested)")
        else:
            found.append(f"{block.where}: ```{block.language} is neither runnable {RUNNABLE} nor ```text")
    return found


def doc_tests(blocks: list[Block]) -> list[DocTest]:
    """The runnable, not skipped blocks, each with the output block that follows it, if any."""
    tests = []
    for block, following in zip(blocks, [*blocks[1:], None], strict=False):  # nothing follows the last
        if block.language in RUNNABLE and block.skip_reason is None and not block.is_output:
            tests.append(DocTest(block, following if following is not None and following.is_output else None))
    return tests


# -- comparing what a block printed with what the document shows ---------------------------------
def text_matches(expected: str, actual: str) -> bool:
    """Exact up to trailing spaces and blank lines at either end, `...` matching any text."""

    def normal(text: str) -> str:
        return "\n".join(line.rstrip() for line in text.strip("\n").splitlines()).strip("\n")

    pattern = ".*?".join(re.escape(part) for part in normal(expected).split("..."))
    return re.fullmatch(pattern, normal(actual), flags=re.DOTALL) is not None


def json_values(text: str) -> list:
    """The JSON values of a text holding one or more (grpcurl prints one per message)."""
    decoder = json.JSONDecoder()
    values, position, text = [], 0, text.strip()
    while position < len(text):
        value, position = decoder.raw_decode(text, position)
        values.append(value)
        while position < len(text) and text[position].isspace():
            position += 1
    return values


def shape_mismatch(expected, actual, where: str = "$") -> str | None:
    """None when every key shown in `expected` is in `actual` with a value of the same JSON type
    (lists: each item shown, against the item at the same place); otherwise where it differs."""
    if isinstance(expected, dict):
        if not isinstance(actual, dict):
            return f"{where}: expected an object, got {actual!r}"
        for key, value in expected.items():
            if key not in actual:
                return f"{where}: no key {key!r} in {sorted(actual)}"
            if (mismatch := shape_mismatch(value, actual[key], f"{where}.{key}")) is not None:
                return mismatch
        return None
    if isinstance(expected, list):
        if not isinstance(actual, list) or len(actual) < len(expected):
            return f"{where}: expected a list of at least {len(expected)}, got {actual!r}"
        for index, value in enumerate(expected):
            if (mismatch := shape_mismatch(value, actual[index], f"{where}[{index}]")) is not None:
                return mismatch
        return None
    if _json_type(expected) != _json_type(actual):
        return f"{where}: expected {_json_type(expected)} like {expected!r}, got {actual!r}"
    return None


def _json_type(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    return type(value).__name__
