"""`textgen-client` installs alone into a fresh venv (no torch, no server) and imports fast."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

CLIENT_DIR = Path(__file__).resolve().parents[2] / "clients" / "python"

# Run in the fresh venv: import time, what got imported, and one real call to the test server.
_PROBE = textwrap.dedent("""
    import importlib.util, json, sys, time
    started = time.perf_counter()
    import textgen_client
    import_s = time.perf_counter() - started
    with textgen_client.Client(sys.argv[1]) as client:
        text = client.generate("the quick brown fox", max_new_tokens=3).generated_text
    print(json.dumps({
        "import_s": import_s, "text": text, "file": textgen_client.__file__,
        "torch_installed": importlib.util.find_spec("torch") is not None,
        "server_importable": importlib.util.find_spec("inference_service") is not None
                             or importlib.util.find_spec("textgen") is not None,
    }))
""")


def _run(*args: str, timeout: float, cwd: Path) -> str:
    # cwd is not the checkout: `python -c` puts the current folder on sys.path.
    done = subprocess.run(args, capture_output=True, text=True, timeout=timeout, cwd=cwd)
    assert done.returncode == 0, f"{args[:4]} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    return done.stdout


def test_installs_into_a_fresh_venv_and_imports_fast(tmp_path, server):
    # A copy: the build writes into its source folder, and the copy proves the folder stands alone.
    source = shutil.copytree(
        CLIENT_DIR, tmp_path / "client", ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__")
    )
    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", str(venv), timeout=60, cwd=tmp_path)
    python = str(venv / "bin" / "python")
    # pip's wheel cache is shared with the machine's, so this is quick after the first time.
    _run(
        python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", str(source), timeout=180, cwd=tmp_path
    )
    output = _run(python, "-c", _PROBE, server.target, timeout=60, cwd=tmp_path)
    probe = json.loads(output.strip().splitlines()[-1])
    assert probe["file"].startswith(str(venv))  # the installed copy, not this checkout
    assert not probe["torch_installed"] and not probe["server_importable"]
    assert probe["import_s"] < 1.0
    assert isinstance(probe["text"], str)
