"""How a REST stream ends tells a client what happened: a final event with `generated_text` (done),
an error event (the server gave up: shutdown, error, its engine-core process died), or a broken
transfer (the server's API process itself died)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from rest_helpers import engine_core_of, finish_stream, openai_chunks, sse_events, start_stream

from gateway.config import GatewayConfig
from gateway.envoy import Envoy
from tests.launched import alive

LONG_STREAM = {"inputs": "hello", "parameters": {"max_new_tokens": 480}}


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
    server.log = []  # its log lines, collected (which also keeps the pipe drained)
    try:
        for line in server.stderr:
            if "serving" in line:
                break
        threading.Thread(target=lambda: server.log.extend(server.stderr), daemon=True).start()
        envoy.start()
        yield server, envoy
    finally:
        envoy.stop()
        if server.poll() is None:
            server.kill()
        server.wait(30)


def stream_and_signal(envoy: Envoy, server: subprocess.Popen, signum: int) -> subprocess.CompletedProcess:
    """curl a long stream; `signum` goes to the server once the first event has arrived."""
    curl, first = start_stream(envoy.url("/generate_stream"), LONG_STREAM)
    assert first.startswith(b'data: {"index":1'), first
    server.send_signal(signum)
    return finish_stream(curl, first)


def test_shutdown_ends_a_stream_with_an_error_event(served):
    server, envoy = served
    result = stream_and_signal(envoy, server, signal.SIGTERM)
    assert result.returncode == 0, result.stderr
    events = sse_events(result.stdout)
    assert events[-1].keys() == {"error", "error_type"} and events[-1]["error_type"] == "cancelled"
    assert all(event["generated_text"] is None for event in events[:-1])
    assert server.wait(30) == 0


def test_a_dead_engine_core_ends_every_stream_with_an_error_event(served):
    """The engine-core process dies (SIGKILL stands for a segfault or the OOM killer): the API process
    ends each stream with a typed error event (TGI's and OpenAI's), reports NOT_SERVING and exits 1."""
    server, envoy = served
    core = engine_core_of(server.pid)
    tgi = start_stream(envoy.url("/generate_stream"), LONG_STREAM)
    openai = start_stream(envoy.url("/v1/completions"), {"prompt": "hello", "max_tokens": 480, "stream": True})
    os.kill(core, signal.SIGKILL)
    tgi_result, openai_result = finish_stream(*tgi), finish_stream(*openai)

    assert tgi_result.returncode == 0, tgi_result.stderr  # a whole body, not a cut transfer
    events = sse_events(tgi_result.stdout)
    assert events[-1] == {"error": events[-1]["error"], "error_type": "unavailable"}, events[-1]
    assert "engine core process was killed by SIGKILL" in events[-1]["error"]
    assert all(event["generated_text"] is None for event in events[:-1])

    assert openai_result.returncode == 0, openai_result.stderr
    chunks = openai_chunks(openai_result.stdout)  # OpenAI's end, [DONE], after the error chunk
    errors = [chunk for chunk in chunks if "error" in chunk]
    assert len(errors) == 1 and errors[0]["error"]["type"] == "server_error", chunks[-2:]
    assert errors[0]["error"]["code"] == "unavailable" and "killed by SIGKILL" in errors[0]["error"]["message"]
    assert all(chunk["choices"][0]["finish_reason"] is None for chunk in chunks if "choices" in chunk)

    assert server.wait(30) == 1  # so whoever runs it starts it again
    log = "".join(server.log)
    assert "not serving any more: the model can no longer run: the engine core process was killed" in log, log


def test_a_dead_api_process_breaks_the_transfer(served):
    """The API process itself dies: Envoy resets the stream after an upstream reset, nothing can
    write an event any more (its engine core follows it out)."""
    server, envoy = served
    core = engine_core_of(server.pid)
    result = stream_and_signal(envoy, server, signal.SIGKILL)
    assert result.returncode == 18, (result.returncode, result.stderr)  # transfer closed, data outstanding
    assert '"generated_text":"' not in result.stdout
    server.wait(30)
    deadline = time.monotonic() + 30
    while alive(core) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(core)
