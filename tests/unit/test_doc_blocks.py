"""The rules of the doc-tests (tests/doc_blocks.py), checked without a server: every block of the
README and docs/*.md runs in tests/e2e/test_readme.py or says why not."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests import doc_blocks

SAMPLE = """\
# Title

```bash
curl localhost:8080/health
```
<!-- output -->
```json
{"a": 1}
```

<!-- not-tested: needs a GPU and a model download -->
```python
import torch
```

- a list item:

  ```python
  print("indented")
  ```

````text
```bash
nested
```
````
"""


def sample_blocks(text: str = SAMPLE) -> list[doc_blocks.Block]:
    return doc_blocks.parse(Path("sample.md"), text)


def test_parse_finds_each_block_with_its_annotation():
    blocks = sample_blocks()
    assert [(b.line, b.language, b.comment) for b in blocks] == [
        (3, "bash", None),
        (7, "json", "output"),
        (12, "python", "not-tested: needs a GPU and a model download"),
        (18, "python", None),
        (22, "text", None),
    ]
    assert blocks[3].code == 'print("indented")'
    assert blocks[4].code == "```bash\nnested\n```"
    assert blocks[2].skip_reason == "needs a GPU and a model download"


def test_doc_tests_pair_code_with_its_output_and_leave_skipped_blocks_out():
    tests = doc_blocks.doc_tests(sample_blocks())
    assert [(test.block.line, test.output and test.output.line) for test in tests] == [(3, 7), (18, None)]
    assert doc_blocks.problems(sample_blocks()) == []
    assert doc_blocks.doc_tests(sample_blocks("No code here.\n")) == []


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("```\nls\n```\n", "neither runnable"),
        ("```console\n$ ls\n```\n", "neither runnable"),
        ("<!-- not-tested -->\n```bash\nmake run\n```\n", "needs a reason"),
        ("<!-- not-tested: slow -->\n```bash\nmake run\n```\n", "needs a reason"),
        ("<!-- maybe -->\n```bash\nls\n```\n", "unknown annotation"),
        ("Some text.\n<!-- output -->\n```text\nhi\n```\n", "output of no runnable block"),
        ("```bash\nls\n```\n<!-- output -->\n```json\n{oops\n```\n", "not JSON"),
        ("<!-- not-tested: a server for ever -->\n```bash\nmake run\n```\n<!-- output -->\n```text\nx\n```", "skipped"),
        ("```text\ncurl localhost:8080/info\n```\n", "a command in a ```text block"),
    ],
)
def test_problems_name_each_broken_rule(text, problem):
    found = doc_blocks.problems(sample_blocks(text))
    assert len(found) == 1 and problem in found[0], found


def test_every_block_of_the_readme_and_docs_is_tested_or_says_why_not():
    blocks = [block for path in doc_blocks.doc_files() for block in doc_blocks.parse(path)]
    assert doc_blocks.problems(blocks) == []
    assert len(doc_blocks.doc_tests(blocks)) >= 8


def test_text_matches_is_exact_but_for_ellipses():
    assert doc_blocks.text_matches("Hello! ...\nbye", "Hello! How are you?\nand more\nbye  \n\n")
    assert not doc_blocks.text_matches("Hello!", "Hello! How are you?")
    assert not doc_blocks.text_matches("a.c", "abc")  # a pattern's dot is a dot


def test_shape_mismatch_checks_shown_keys_and_types():
    shown = {"generated_text": "x", "details": {"tokens": [{"id": 1, "special": False}], "seed": None}}
    actual = {"generated_text": "y", "details": {"tokens": [{"id": 7, "special": True}, {}], "seed": None, "n": 2}}
    assert doc_blocks.shape_mismatch(shown, actual) is None
    no_seed = {**actual, "details": {"tokens": [{"id": 1, "special": False}]}}
    assert "no key 'seed'" in doc_blocks.shape_mismatch(shown, no_seed)
    assert "$.details.tokens[0].special" in doc_blocks.shape_mismatch(
        shown, {**actual, "details": {"tokens": [{"id": 1, "special": 0}], "seed": None}}
    )
    assert doc_blocks.json_values('{"a": 1}\n{\n  "b": [2]\n}\n') == [{"a": 1}, {"b": [2]}]


def heading_anchors(path: Path) -> set[str]:
    """GitHub's anchors of a Markdown file's headings: lower case, punctuation dropped, spaces to dashes."""
    headings = re.findall(r"^#+ (.+)$", path.read_text(), flags=re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-") for heading in headings}


def test_links_between_the_documents_resolve():
    broken = []
    for path in doc_blocks.doc_files():
        for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
            if target.startswith(("http://", "https://")):
                continue
            file, _, anchor = target.partition("#")
            linked = (path.parent / file).resolve() if file else path
            if not linked.exists() or (anchor and anchor not in heading_anchors(linked)):
                broken.append(f"{path.name}: {target}")
    assert broken == []
