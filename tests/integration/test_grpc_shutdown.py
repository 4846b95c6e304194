"""SIGTERM on a real `inference-service serve` process: drain, then exit 0."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from textgen.v1 import generate_pb2 as pb
from textgen.v1 import generate_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT = 120
LONG = pb.GenerateRequest(inputs="a", parameters=pb.GenerateParameters(max_new_tokens=300, details=True))


class ServeProcess:
    """`python -m inference_service serve` on a free port; its stderr is collected as it comes."""

    def __init__(self, model_dir: Path, *flags: str):
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "inference_service",
                "serve",
                "--model-id",
                str(model_dir),
                "--device",
                "cpu",
                "--hostname",
                "127.0.0.1",
                "--grpc-port",
                "0",
                "--max-total-tokens",
                "512",
                "--max-batch-total-tokens",
                "4096",
                *flags,
            ],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: list[str] = []
        self._port_found = threading.Event()
        self.port: int | None = None
        threading.Thread(target=self._read, daemon=True).start()
        if not self._port_found.wait(STARTUP_TIMEOUT):
            self.kill()
            pytest.fail("the server never said where it listens:\n" + "".join(self.lines))
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        self.stub = generate_pb2_grpc.TextGenerationStub(self.channel)
        self._wait_serving()

    def _read(self) -> None:
        for line in self.process.stderr:
            self.lines.append(line)
            match = re.search(r"listening on 127\.0\.0\.1:(\d+)", line)
            if match:
                self.port = int(match.group(1))
                self._port_found.set()

    def _wait_serving(self) -> None:
        health = health_pb2_grpc.HealthStub(self.channel)
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while time.monotonic() < deadline:
            status = health.Check(health_pb2.HealthCheckRequest(), timeout=10).status
            if status == health_pb2.HealthCheckResponse.SERVING:
                return
            time.sleep(0.1)
        self.kill()
        pytest.fail("the server never became SERVING:\n" + "".join(self.lines))

    def terminate_and_wait(self, timeout: float = 60) -> int:
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)


@pytest.fixture
def serve_process(tiny_model_dir):
    started: list[ServeProcess] = []

    def start(*flags: str) -> ServeProcess:
        started.append(ServeProcess(tiny_model_dir, *flags))
        return started[-1]

    yield start
    for server in started:
        server.channel.close()
        server.kill()


def test_sigterm_lets_the_request_finish_and_exits_0(serve_process):
    server = serve_process("--json-output")
    stream = server.stub.GenerateStream(LONG, timeout=STARTUP_TIMEOUT)
    first = next(stream)
    assert first.index == 1
    server.process.send_signal(signal.SIGTERM)
    rest = list(stream)
    assert stream.code() == grpc.StatusCode.OK
    assert rest[-1].details.generated_tokens == len(rest) + 1
    assert server.process.wait(60) == 0
    messages = [json.loads(line)["message"] for line in server.lines if line.strip()]  # JSON lines only
    assert any(m.startswith("draining") for m in messages) and messages[-1] == "stopped"


def test_sigterm_past_the_timeout_cancels_and_exits_0(serve_process):
    server = serve_process("--graceful-termination-timeout", "0")
    stream = server.stub.GenerateStream(LONG, timeout=STARTUP_TIMEOUT)
    next(stream)
    assert server.terminate_and_wait() == 0
    with pytest.raises(grpc.RpcError) as raised:
        list(stream)
    assert raised.value.code() == grpc.StatusCode.CANCELLED
    assert "Traceback" not in "".join(server.lines)
