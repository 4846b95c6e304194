"""The Triton paged attention's checks (triton_paged_checks.py), run under Triton's interpreter in a
process of their own: `triton.jit` picks the interpreter when triton is first imported, and in this
process something (transformers, torch) may already have imported it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[dev]')")

CHECKS = Path(__file__).with_name("triton_paged_checks.py")


def test_kernel_checks_pass_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(CHECKS)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert re.search(r"^7 passed", done.stdout, re.MULTILINE), done.stdout[-2000:]
