"""Through the real Envoy: a REST call with a caller's `traceparent` becomes one trace, Envoy's span →
the server's gRPC span → the engine spans; and GET /metrics on the gateway counts what was sent."""

from __future__ import annotations

import json
import urllib.request

import pytest
from otlp_receiver import SERVICE
from prometheus_client.parser import text_string_to_metric_families

from gateway.config import GatewayConfig
from gateway.envoy import Envoy, GatewayError, envoy_binary

pytestmark = pytest.mark.e2e

TIMEOUT = 60
ENVOY_FLUSH_S = 20  # Envoy's tracer flushes every 5 s by default
ENGINE_SPANS = {"validation", "queued", "inference"}
GATEWAY_SERVICE = f"{SERVICE}-gateway"


@pytest.fixture(scope="module")
def gateway(traced_server, otlp_receiver, tmp_path_factory):
    try:
        envoy_binary()
    except GatewayError as error:
        pytest.skip(str(error))
    config = GatewayConfig(
        hostname="127.0.0.1",
        port=0,
        upstream_host="127.0.0.1",
        upstream_port=traced_server.port,
        admin_port=0,
        otlp_endpoint=otlp_receiver.endpoint,
        otlp_service_name=GATEWAY_SERVICE,
    )
    envoy = Envoy(config, tmp_path_factory.mktemp("envoy-traced"))
    envoy.start()
    yield envoy
    envoy.stop()


def post(envoy: Envoy, path: str, body: dict, headers: dict[str, str]) -> bytes:
    request = urllib.request.Request(
        envoy.url(path),
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json", **headers},
    )
    with urllib.request.urlopen(request, timeout=TIMEOUT) as response:
        assert response.status == 200
        return response.read()


@pytest.mark.parametrize(("path", "rpc"), [("/generate", "Generate"), ("/generate_stream", "GenerateStream")])
def test_rest_span_is_the_parent_of_the_grpc_span(gateway, traced_server, otlp_receiver, traceparent, path, rpc):
    trace_id, caller_span_id, header = traceparent
    post(gateway, path, {"inputs": "the quick brown fox", "parameters": {"max_new_tokens": 3}}, {"traceparent": header})
    traced_server.server.observability.tracing.provider.force_flush()
    server_name = f"/textgen.v1.TextGeneration/{rpc}"
    rest_name = f"POST {path}"
    spans = otlp_receiver.wait_for(trace_id, ENGINE_SPANS | {server_name, rest_name}, timeout=ENVOY_FLUSH_S)
    [rest_span], [server_span] = spans[rest_name], spans[server_name]
    assert rest_span.service == GATEWAY_SERVICE and rest_span.parent_span_id == caller_span_id
    assert server_span.service == SERVICE and server_span.parent_span_id == rest_span.span_id
    assert rest_span.start_ns <= server_span.start_ns
    for name in ENGINE_SPANS:
        [span] = spans[name]
        assert span.parent_span_id == server_span.span_id
    assert spans["inference"][0].attributes["gen_ai.usage.output_tokens"] == 3


def test_metrics_through_the_gateway(gateway, traced_server):
    def scrape() -> dict:
        with urllib.request.urlopen(gateway.url("/metrics"), timeout=TIMEOUT) as response:
            assert response.headers["content-type"].startswith("text/plain")
            text = response.read().decode()
        assert "\ntgi_request_count " in text  # TGI's counter names, as TGI renders them
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    before = scrape()
    for _ in range(2):
        post(gateway, "/generate", {"inputs": "hello", "parameters": {"max_new_tokens": 2}}, {})
    with pytest.raises(urllib.error.HTTPError) as raised:
        post(gateway, "/generate", {"inputs": "hello", "parameters": {"temperature": 0.0}}, {})
    assert raised.value.code == 422
    after = scrape()

    def moved(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0) - before.get(key, 0)

    assert moved("tgi_request_count_total") == 3 and moved("tgi_request_success_total") == 2
    assert moved("tgi_request_failure_total", err="validation") == 1
