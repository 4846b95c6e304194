"""openmp_wait: importing the package bounds libgomp's spinning before torch can load it, and keeps
a value the operator set."""

from __future__ import annotations

import os
import subprocess
import sys

CHILD = """
import os, sys
import inference_service.cli  # what the `inference-service` command imports first
print(os.environ.get("GOMP_SPINCOUNT"), "torch" in sys.modules)
"""


def run_child(env: dict[str, str]) -> str:
    result = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_the_spin_count_is_bounded_on_import_unless_the_operator_set_one():
    env = {key: value for key, value in os.environ.items() if key != "GOMP_SPINCOUNT"}
    assert run_child(env).split()[0] == "10000"
    assert run_child({**env, "GOMP_SPINCOUNT": "300000"}).split()[0] == "300000"
