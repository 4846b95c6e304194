"""How a REST stream ends tells a client what happened: a final event with `generated_text` (done),
an error event (the server gave up: shutdown, error), or a broken transfer (the server died)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from rest_helpers import sse_events

from gateway.config import GatewayConfig
from gateway.envoy import Envoy


@pytest.fixture
def served(tiny_model_dir, tmp_path, envoy_installed):
    """`inference-service serve` as its own process (so it can be killed), with Envoy in front."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        grpc_port = probe.getsockname()[1]
    command = [
        str(Path(sys.executable).with_name("inference-service")),
        "serve",
        "--model-id",
        str(tiny_model_dir),
        "--device",
        "cpu",
        "--hostname",
        "127.0.0.1",
        "--grpc-port",
        str(grpc_port),
        "--max-total-tokens",
        "512",
        "--max-batch-total-tokens",
        "4096",
        "--graceful-termination-timeout",
        "0",
    ]
    server = subprocess.Popen(
        command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    envoy = Envoy(GatewayConfig(hostname="127.0.0.1", port=0, upstream_port=grpc_port, admin_port=0), tmp_path)
    try:
        for line in server.stderr:
            if "serving" in line:
                break
        threading.Thread(target=server.stderr.read, daemon=True).start()  # keep the pipe drained
        envoy.start()
        yield server, envoy
    finally:
        envoy.stop()
        if server.poll() is None:
            server.kill()
        server.wait(30)


def stream_and_signal(envoy: Envoy, server: subprocess.Popen, signum: int) -> subprocess.CompletedProcess:
    """curl a long stream; `signum` goes to the server once the first event has arrived."""
    body = json.dumps({"inputs": "hello", "parameters": {"max_new_tokens": 480}})
    errors = envoy.workdir / "curl.stderr"
    with errors.open("wb") as error_file:
        curl = subprocess.Popen(
            [
                "curl",
                "-sS",
                "-N",
                "--max-time",
                "60",
                envoy.url("/generate_stream"),
                "-H",
                "Content-Type: application/json",
                "-d",
                body,
            ],
            stdout=subprocess.PIPE,
            stderr=error_file,
        )
        first = curl.stdout.readline()
        assert first.startswith(b'data: {"index":1'), first
        server.send_signal(signum)
        output = first + curl.stdout.read()
        curl.wait(60)
    return subprocess.CompletedProcess(curl.args, curl.returncode, output.decode(), errors.read_text())


def test_shutdown_ends_a_stream_with_an_error_event(served):
    server, envoy = served
    result = stream_and_signal(envoy, server, signal.SIGTERM)
    assert result.returncode == 0, result.stderr
    events = sse_events(result.stdout)
    assert events[-1].keys() == {"error", "error_type"} and events[-1]["error_type"] == "cancelled"
    assert all(event["generated_text"] is None for event in events[:-1])
    assert server.wait(30) == 0


def test_a_dead_server_breaks_the_transfer(served):
    server, envoy = served
    result = stream_and_signal(envoy, server, signal.SIGKILL)
    assert result.returncode == 18, (result.returncode, result.stderr)  # transfer closed, data outstanding
    assert '"generated_text":"' not in result.stdout
