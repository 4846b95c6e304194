"""`inference-service launch` as a user runs it: the server and Envoy come up together, Envoy is
restarted when it dies (and the command gives up, exit 1, when it keeps dying), SIGTERM stops both."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from gateway.launch import MAX_RESTARTS

START_TIMEOUT_S = 120


class Launched:
    """A running `inference-service launch`; its log lines are collected as they come."""

    def __init__(self, model_dir: Path):
        command = [str(Path(sys.executable).with_name("inference-service")), "launch",
                   "--model-id", str(model_dir), "--device", "cpu", "--hostname", "127.0.0.1",
                   "--port", "0", "--grpc-port", "0", "--max-total-tokens", "512",
                   "--max-batch-total-tokens", "4096", "--graceful-termination-timeout", "5"]
        self.process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        threading.Thread(target=self._collect, daemon=True).start()

    def _collect(self) -> None:
        for line in self.process.stderr:
            self.lines.append(line.rstrip())

    def matches(self, pattern: str) -> list[re.Match]:
        return [match for line in list(self.lines) if (match := re.search(pattern, line))]

    def wait_for(self, pattern: str, count: int = 1, timeout_s: float = START_TIMEOUT_S) -> re.Match:
        """The `count`-th log line matching `pattern`, once it is there."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = self.matches(pattern)
            if len(found) >= count:
                return found[count - 1]
            if self.process.poll() not in (None, 0):
                break
            time.sleep(0.05)
        raise AssertionError(f"no {pattern!r} (x{count}) in the log:\n{self.log()}")

    def log(self) -> str:
        return "\n".join(self.lines)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)


@pytest.fixture
def launched(tiny_model_dir, envoy_installed):
    runs: list[Launched] = []

    def start() -> Launched:
        runs.append(Launched(tiny_model_dir))
        return runs[-1]

    yield start
    for run in runs:
        run.stop()


def get(url: str) -> tuple[int, bytes]:
    with urllib.request.urlopen(url, timeout=30) as response:
        return response.status, response.read()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()


def test_launch_restarts_envoy_and_stops_cleanly(launched):
    run = launched()
    ready = run.wait_for(r"ready: TGI REST API on (http://\S+), gRPC API on port (\d+)")
    url = ready.group(1)
    envoy_pid = int(run.wait_for(r"Envoy (\d+): REST on port").group(1))
    assert get(url + "/health") == (200, b"")
    request = urllib.request.Request(url + "/generate", data=b'{"inputs":"hello","parameters":{"max_new_tokens":3}}',
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        assert b"generated_text" in response.read()

    os.kill(envoy_pid, signal.SIGKILL)
    restarted = int(run.wait_for(r"Envoy restarted \(pid (\d+)\)", timeout_s=30).group(1))
    assert restarted != envoy_pid
    assert get(url + "/health") == (200, b"")  # same port

    run.process.send_signal(signal.SIGTERM)
    assert run.process.wait(30) == 0, run.log()
    assert not alive(restarted)


def test_launch_gives_up_when_envoy_keeps_dying(launched):
    run = launched()
    run.wait_for(r"ready: TGI REST API")
    pid = int(run.wait_for(r"Envoy (\d+): REST on port").group(1))
    for restart in range(1, MAX_RESTARTS + 1):
        os.kill(pid, signal.SIGKILL)
        pid = int(run.wait_for(r"Envoy restarted \(pid (\d+)\)", count=restart, timeout_s=30).group(1))
    os.kill(pid, signal.SIGKILL)
    assert run.process.wait(30) == 1, run.log()
    assert "shutting down" in run.log()


def test_envoy_does_not_outlive_a_killed_launcher(launched):
    run = launched()
    run.wait_for(r"ready: TGI REST API")
    envoy_pid = int(run.wait_for(r"Envoy (\d+): REST on port").group(1))
    run.process.kill()
    run.process.wait(10)
    deadline = time.monotonic() + 10
    while alive(envoy_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(envoy_pid)
