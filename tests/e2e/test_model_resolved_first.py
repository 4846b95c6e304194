"""A model that can't be found stops `launch` and `serve` before anything starts: one line on stderr,
exit 1, no gRPC port listening, Envoy never run (its binary here only leaves a mark if it is run)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

COMMAND = str(Path(sys.executable).with_name("inference-service"))
# The log lines each part writes as it starts.
STARTED = ("gRPC API listening", "Envoy", "loading model")


@pytest.fixture
def envoy_marker(tmp_path) -> tuple[Path, Path]:
    """(a stand-in Envoy binary, the file it creates when run)."""
    marker = tmp_path / "envoy-ran"
    binary = tmp_path / "envoy"
    binary.write_text(f"#!/bin/sh\ntouch {marker}\nexit 1\n")
    binary.chmod(0o755)
    return binary, marker


CASES = {  # name: (model id, environment, the error line's start)
    "missing-folder": ("/no/such/models/llama", {}, "model folder '/no/such/models/llama' does not exist"),
    "missing-gguf": ("./nowhere/tiny.Q4_0.gguf", {}, "GGUF file 'nowhere/tiny.Q4_0.gguf' does not exist"),
    "unknown-id-offline": (
        "acme/no-such-model",
        {"HF_HUB_OFFLINE": "1"},
        "could not fetch 'acme/no-such-model' from the Hugging Face hub: offline mode is on",
    ),
}


# Each run imports torch (seconds): `serve` is checked on one case.
RUNS = [("launch", case) for case in CASES] + [("serve", "missing-folder")]


@pytest.mark.parametrize(("command", "case"), RUNS)
def test_a_model_that_cant_be_found_starts_nothing(command, case, tmp_path, envoy_marker):
    model_id, environ, message = CASES[case]
    envoy, marker = envoy_marker
    gateway = ["--port", "0", "--envoy-binary", str(envoy)] if command == "launch" else []
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "XDG_CACHE_HOME": str(tmp_path / "cache"), **environ}
    result = subprocess.run(
        [
            COMMAND,
            command,
            "--model-id",
            model_id,
            "--hostname",
            "127.0.0.1",
            "--grpc-port",
            "0",
            "--prometheus-port",
            "0",
            *gateway,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=tmp_path,
    )
    assert result.returncode == 1, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith(f"inference-service: error: {message}"), result.stderr
    assert "Traceback" not in result.stderr
    assert not any(started in line for line in lines for started in STARTED), result.stderr
    assert not marker.exists()  # Envoy was never run
