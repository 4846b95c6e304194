"""`inference-service launch` as a user runs it: the server and Envoy come up together, Envoy is
restarted when it dies (and the command gives up, exit 1, when it keeps dying), SIGTERM stops both."""

from __future__ import annotations

import os
import signal
import time
import urllib.request

from gateway.launch import MAX_RESTARTS
from tests.launched import alive


def get(url: str) -> tuple[int, bytes]:
    with urllib.request.urlopen(url, timeout=30) as response:
        return response.status, response.read()


def test_launch_restarts_envoy_and_stops_cleanly(launched):
    run = launched()
    ready = run.wait_for(r"ready: TGI REST API on (http://\S+), gRPC API on port (\d+)")
    url = ready.group(1)
    envoy_pid = int(run.wait_for(r"Envoy (\d+): REST on port").group(1))
    assert get(url + "/health") == (200, b"")
    request = urllib.request.Request(
        url + "/generate",
        data=b'{"inputs":"hello","parameters":{"max_new_tokens":3}}',
        headers={"Content-Type": "application/json"},
    )
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
