"""`inference-service launch --otlp-endpoint ... --prometheus-port 0 --json-output` as an operator runs
it: one REST call is one trace from Envoy down to the engine, counted on the metrics port, and one
JSON log line that carries the trace id and Envoy's request id."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.e2e

START_TIMEOUT_S = 120
SERVICE = "launched"


class Launched:
    def __init__(self, model_dir: Path, otlp_endpoint: str):
        command = [str(Path(sys.executable).with_name("inference-service")), "launch",
                   "--model-id", str(model_dir), "--device", "cpu", "--hostname", "127.0.0.1",
                   "--port", "0", "--grpc-port", "0", "--prometheus-port", "0", "--max-total-tokens", "512",
                   "--max-batch-total-tokens", "4096", "--graceful-termination-timeout", "5", "--json-output",
                   "--otlp-endpoint", otlp_endpoint, "--otlp-service-name", SERVICE]
        self.process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        threading.Thread(target=self._collect, daemon=True).start()

    def _collect(self) -> None:
        for line in self.process.stderr:
            self.lines.append(line.rstrip())

    def entries(self) -> list[dict]:
        return [json.loads(line) for line in list(self.lines) if line.startswith("{")]

    def wait_for(self, pattern: str) -> re.Match:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline and self.process.poll() is None:
            for entry in self.entries():
                if match := re.search(pattern, entry["message"]):
                    return match
            time.sleep(0.05)
        raise AssertionError(f"no {pattern!r} in the log:\n" + "\n".join(self.lines))

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)


@pytest.fixture
def launched(tiny_model_dir, otlp_receiver):
    from gateway.envoy import GatewayError, envoy_binary

    try:
        envoy_binary()
    except GatewayError as error:
        pytest.skip(str(error))
    run = Launched(tiny_model_dir, otlp_receiver.endpoint)
    yield run
    run.stop()


def test_one_rest_call_traced_counted_and_logged(launched, otlp_receiver, traceparent):
    rest_url = launched.wait_for(r"ready: TGI REST API on (\S+),").group(1)
    metrics_port = int(launched.wait_for(r"Prometheus metrics on \S+:(\d+)").group(1))
    trace_id, caller_span_id, header = traceparent
    request = urllib.request.Request(
        f"{rest_url}/generate", method="POST", headers={"Content-Type": "application/json", "traceparent": header},
        data=json.dumps({"inputs": "hello there", "parameters": {"max_new_tokens": 3}}).encode())
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.status == 200

    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as response:
        samples = {s.name: s.value for family in text_string_to_metric_families(response.read().decode())
                   for s in family.samples if not s.labels}
    assert samples["tgi_request_count_total"] == samples["tgi_request_success_total"] == 1

    # Both export in batches every few seconds (Envoy's tracer each 5 s): wait while they run.
    spans = otlp_receiver.wait_for(trace_id, {"POST /generate", "/textgen.v1.TextGeneration/Generate", "inference"},
                                   timeout=20)
    launched.process.send_signal(signal.SIGTERM)
    assert launched.process.wait(60) == 0
    [rest], [server], [inference] = spans["POST /generate"], spans["/textgen.v1.TextGeneration/Generate"], \
        spans["inference"]
    assert rest.service == f"{SERVICE}-gateway" and rest.parent_span_id == caller_span_id
    assert server.service == SERVICE and server.parent_span_id == rest.span_id
    assert inference.parent_span_id == server.span_id

    [line] = [entry for entry in launched.entries() if entry["target"] == "inference_service.requests"]
    assert line["level"] == "INFO" and line["trace_id"] == trace_id and line["generated_tokens"] == 3
    assert line["request_id"] == rest.attributes["guid:x-request-id"]  # Envoy's request id, end to end
