"""Doc-tests: every code block of README.md and docs/*.md runs, as pasted, against a launched demo
model (`inference-service launch`, real Envoy), and prints what the document says it prints.

The rules for blocks (runnable, `<!-- not-tested: why -->`, `<!-- output -->`) are in tests/doc_blocks.py;
tests/unit/test_doc_blocks.py checks them without a server. One launch serves the whole module.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import doc_blocks
from tests.doc_blocks import ROOT, DocTest

pytestmark = pytest.mark.slow

BLOCK_TIMEOUT_S = 300
VENV_BIN = Path(sys.executable).parent
# curl as a user sees it, except that an HTTP error fails the block (a user would see the error body).
BASH_PRELUDE = 'set -eo pipefail\ncurl() { command curl --silent --show-error --fail-with-body "$@"; }\n'

DOC_TESTS = [test for path in doc_blocks.doc_files() for test in doc_blocks.doc_tests(doc_blocks.parse(path))]


@pytest.fixture(scope="module")
def ports(envoy_installed) -> dict[str, int]:
    """The demo model served as `make run` serves it (loopback, free ports): REST, gRPC, metrics."""
    from inference_service.config import DEMO_MODEL_ID
    from inference_service.models import demo
    from tests.launched import Launched

    demo.ensure_demo_model()
    run = Launched(Path(DEMO_MODEL_ID), "--prometheus-port", "0")
    try:
        ready = run.wait_for(r"ready: TGI REST API on http://[^:]+:(\d+), gRPC API on port (\d+)", timeout_s=600)
        metrics = run.wait_for(r"Prometheus metrics on \S+:(\d+)")
        yield {"8080": int(ready[1]), "50051": int(ready[2]), "9000": int(metrics[1])}
    finally:
        run.stop()


def localized(code: str, ports: dict[str, int]) -> str:
    """The block with the test server's ports and this venv's tools in place of the document's."""
    for documented, port in ports.items():
        for host in ("localhost", "127.0.0.1"):
            code = code.replace(f"{host}:{documented}", f"127.0.0.1:{port}")
    return code.replace(".venv/bin/", f"{VENV_BIN}/")


def run_block(test: DocTest, ports: dict[str, int], tmp_path: Path) -> subprocess.CompletedProcess:
    code = localized(test.block.code, ports)
    if test.block.language == "python":
        script = tmp_path / "block.py"
        script.write_text(code)
        command = [sys.executable, str(script)]
    else:
        command = ["bash", "-c", BASH_PRELUDE + code]
    env = {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    return subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S, stdin=subprocess.DEVNULL
    )


@pytest.mark.parametrize("test", DOC_TESTS, ids=[test.block.where for test in DOC_TESTS])
def test_block_runs_and_prints_what_the_document_shows(test: DocTest, ports, tmp_path):
    result = run_block(test, ports, tmp_path)
    shown = f"{test.block.where}\n--- code\n{test.block.code}\n--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"
    assert result.returncode == 0, shown
    assert "Traceback" not in result.stderr, shown
    if test.output is None:
        return
    if test.output.language == "json":
        expected, actual = doc_blocks.json_values(test.output.code), doc_blocks.json_values(result.stdout)
        assert len(actual) == len(expected), shown
        for shown_value, printed in zip(expected, actual, strict=True):
            mismatch = doc_blocks.shape_mismatch(shown_value, printed)
            assert mismatch is None, f"{mismatch}\n{shown}"
    else:
        assert doc_blocks.text_matches(test.output.code, result.stdout), f"expected:\n{test.output.code}\n{shown}"


def test_the_documents_have_doc_tests():
    """The README keeps runnable examples (an empty list would make the test above vacuous)."""
    assert sum(test.block.path.name == "README.md" for test in DOC_TESTS) >= 8
    assert any(test.output is not None for test in DOC_TESTS)
