"""`inference-service launch --otlp-endpoint ... --prometheus-port 0 --json-output` as an operator runs
it: one REST call is one trace from Envoy down to the engine, counted on the metrics port, and one
JSON log line that carries the trace id and Envoy's request id."""

from __future__ import annotations

import json
import signal
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.launched import Launched

pytestmark = pytest.mark.e2e

SERVICE = "launched"


def json_message(line: str) -> str | None:
    return json.loads(line)["message"] if line.startswith("{") else None


def entries(run: Launched) -> list[dict]:
    return [json.loads(line) for line in list(run.lines) if line.startswith("{")]


@pytest.fixture
def launched(tiny_model_dir, otlp_receiver):
    from gateway.envoy import GatewayError, envoy_binary

    try:
        envoy_binary()
    except GatewayError as error:
        pytest.skip(str(error))
    run = Launched(
        tiny_model_dir,
        "--prometheus-port",
        "0",
        "--json-output",
        "--otlp-endpoint",
        otlp_receiver.endpoint,
        "--otlp-service-name",
        SERVICE,
        message_of=json_message,
    )
    yield run
    run.stop()


def test_one_rest_call_traced_counted_and_logged(launched, otlp_receiver, traceparent):
    rest_url = launched.wait_for(r"ready: TGI REST API on (\S+),").group(1)
    metrics_port = int(launched.wait_for(r"Prometheus metrics on \S+:(\d+)").group(1))
    trace_id, caller_span_id, header = traceparent
    request = urllib.request.Request(
        f"{rest_url}/generate",
        method="POST",
        headers={"Content-Type": "application/json", "traceparent": header},
        data=json.dumps({"inputs": "hello there", "parameters": {"max_new_tokens": 3}}).encode(),
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.status == 200

    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as response:
        samples = {
            s.name: s.value
            for family in text_string_to_metric_families(response.read().decode())
            for s in family.samples
            if not s.labels
        }
    assert samples["tgi_request_count_total"] == samples["tgi_request_success_total"] == 1

    # Both export in batches every few seconds (Envoy's tracer each 5 s): wait while they run.
    spans = otlp_receiver.wait_for(
        trace_id, {"POST /generate", "/textgen.v1.TextGeneration/Generate", "inference"}, timeout=20
    )
    launched.process.send_signal(signal.SIGTERM)
    assert launched.process.wait(60) == 0
    [rest], [server], [inference] = (
        spans["POST /generate"],
        spans["/textgen.v1.TextGeneration/Generate"],
        spans["inference"],
    )
    assert rest.service == f"{SERVICE}-gateway" and rest.parent_span_id == caller_span_id
    assert server.service == SERVICE and server.parent_span_id == rest.span_id
    assert inference.parent_span_id == server.span_id

    [line] = [entry for entry in entries(launched) if entry["target"] == "inference_service.requests"]
    assert line["level"] == "INFO" and line["trace_id"] == trace_id and line["generated_tokens"] == 3
    assert line["request_id"] == rest.attributes["guid:x-request-id"]  # Envoy's request id, end to end
