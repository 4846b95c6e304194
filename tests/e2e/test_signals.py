"""Ctrl-C and SIGTERM on a real `inference-service launch`, in each phase: the command exits 0
with one line saying where it stopped, never a traceback or an abort, and leaves no Envoy, replica
or listening port behind. A second signal while draining stops at once and says what it cut.

A phase is held open with the test-only `INFERENCE_SERVICE_TEST_PHASE_DELAY` ("<phase>=<seconds>",
`inference_service/progress.py`), requests with `INFERENCE_SERVICE_TEST_STEP_DELAY_MS`. The default
run covers the phases where things went wrong (before serving, loading, warming up, draining twice);
`pytest -m soak tests/e2e/test_signals.py` sends both signals in every phase, replicas included.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import threading
import time
import urllib.request

import pytest

from tests.launched import Launched, alive

HELD_S = "600"  # a held phase outlasts any test: only the signal ends it
PHASE_DELAY = "INFERENCE_SERVICE_TEST_PHASE_DELAY"
STEP_DELAY = "INFERENCE_SERVICE_TEST_STEP_DELAY_MS"
FORBIDDEN = ("Traceback", "terminate called", "core dumped", "Aborted")


@pytest.fixture
def launch(tiny_model_dir, envoy_installed):
    runs: list[Launched] = []

    def start(*extra: str, env: dict[str, str] | None = None) -> Launched:
        runs.append(Launched(tiny_model_dir, "--prometheus-port", "0", *extra, env=env))
        return runs[-1]

    yield start
    for run in runs:
        run.stop()


def listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def stopped_cleanly(run: Launched, last: str, children: list[int], ports: list[int]) -> None:
    """Exit 0, `last` in the last line, nothing that looks like a crash, no child or port left."""
    code = run.process.wait(60)
    time.sleep(0.2)  # the log reader gets the last lines
    log = run.log()
    assert code == 0, log
    assert re.search(last, run.lines[-1]), log
    assert not any(word in log for word in FORBIDDEN), log
    assert "%|" not in log, "a progress bar in a log that is not a terminal:\n" + log
    assert not [pid for pid in children if alive(pid)], log
    assert not [port for port in ports if listening(port)], log


def ports_and_envoy(run: Launched) -> tuple[list[int], list[int]]:
    grpc_port = int(run.wait_for(r"gRPC API listening on 127\.0\.0\.1:(\d+)").group(1))
    envoy = run.wait_for(r"Envoy (\d+): REST on port (\d+)")
    return [int(envoy.group(1))], [grpc_port, int(envoy.group(2))]


def test_a_signal_before_serving_stops_at_once(launch):
    run = launch()
    run.wait_for(r"starting: model")
    run.process.send_signal(signal.SIGINT)
    stopped_cleanly(run, r"stopped \(SIGINT\) before serving", [], [])


# Each phase, and the log line that comes just before it starts.
PHASES = {
    "loading weights": r"loading model",
    "checking the model": r"loaded weights in",
    "preparing the engine": r"checked the paged attention in",
    "warming up": r"prepared the engine in",
}


@pytest.mark.parametrize(
    ("phase", "signum"), [("loading weights", signal.SIGINT), ("warming up", signal.SIGTERM)], ids=["int", "term"]
)
def test_a_signal_while_loading_stops_cleanly(launch, phase, signum):
    run = launch(env={PHASE_DELAY: f"{phase}={HELD_S}"})
    children, ports = ports_and_envoy(run)
    run.wait_for(PHASES[phase])
    time.sleep(0.5)  # inside the held phase (its torch ops), where an exit used to abort the process
    run.process.send_signal(signum)
    stopped_cleanly(run, rf"stopped \({signum.name}\) while the model was loading", children, ports)


def test_a_second_sigint_cuts_the_drain_short(launch):
    run = launch("--graceful-termination-timeout", "600", env={STEP_DELAY: "200"})
    children, ports = ports_and_envoy(run)
    url = run.wait_for(r"ready: TGI REST API on (http://[^\s,]+)").group(1)
    first_token = threading.Event()
    ended: list[str] = []

    def stream() -> None:
        body = json.dumps({"inputs": "a", "parameters": {"max_new_tokens": 400}}).encode()
        request = urllib.request.Request(
            url + "/generate_stream", data=body, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                for line in response:
                    first_token.set()
                    ended.append(line.decode())
        except Exception as error:  # noqa: BLE001 — the cut, whatever form it takes
            ended.append(repr(error))
        first_token.set()

    reader = threading.Thread(target=stream, daemon=True)
    reader.start()
    assert first_token.wait(60), run.log()
    run.process.send_signal(signal.SIGINT)
    run.wait_for(r"draining")
    run.process.send_signal(signal.SIGINT)
    stopped_cleanly(run, r"^.*stopped$", children, ports)
    assert len(run.matches(r"stopped at once: 1 request cut")) == 1, run.log()
    reader.join(30)
    assert not any('"finish_reason":"length"' in line for line in ended)  # cut, not finished


# -- every phase, both signals (soak) -------------------------------------------------------------
@pytest.mark.soak
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["int", "term"])
@pytest.mark.parametrize("phase", PHASES)
def test_every_phase_stops_cleanly(launch, phase, signum):
    run = launch(env={PHASE_DELAY: f"{phase}={HELD_S}"})
    children, ports = ports_and_envoy(run)
    run.wait_for(PHASES[phase])
    time.sleep(1)
    run.process.send_signal(signum)
    stopped_cleanly(run, rf"stopped \({signum.name}\) while the model was loading", children, ports)


@pytest.mark.soak
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["int", "term"])
def test_a_signal_while_serving_drains_and_stops(launch, signum):
    run = launch()
    children, ports = ports_and_envoy(run)
    run.wait_for(r"ready: TGI REST API")
    run.process.send_signal(signum)
    stopped_cleanly(run, r"stopped$", children, ports)


@pytest.mark.soak
def test_replicas_stop_while_loading_and_leave_nothing(launch):
    run = launch("--num-replicas", "2", env={PHASE_DELAY: f"warming up={HELD_S}"})
    replicas = [int(m.group(1)) for m in [run.wait_for(r"replica \d+ \(pid (\d+)\)", count=i) for i in (1, 2)]]
    envoy = run.wait_for(r"Envoy (\d+): REST on port (\d+)")
    run.wait_for(r"prepared the engine in", count=2)
    time.sleep(1)
    run.process.send_signal(signal.SIGINT)
    code = run.process.wait(60)
    assert code == 0, run.log()
    assert not any(word in run.log() for word in FORBIDDEN), run.log()
    assert not [pid for pid in [*replicas, int(envoy.group(1))] if alive(pid)]
    assert not listening(int(envoy.group(2)))
