"""Envoy's tracing config as rendered: only with an OTLP endpoint, valid for the real Envoy."""

from __future__ import annotations

import subprocess

import pytest

from gateway.config import COLLECTOR_CLUSTER, GatewayConfig, render, render_yaml


def manager(bootstrap: dict) -> dict:
    [listener] = bootstrap["static_resources"]["listeners"]
    return listener["filter_chains"][0]["filters"][0]["typed_config"]


def test_no_endpoint_no_tracing():
    bootstrap = render(GatewayConfig())
    assert "tracing" not in manager(bootstrap)
    assert [c["name"] for c in bootstrap["static_resources"]["clusters"]] == ["textgen"]
    routes = manager(bootstrap)["route_config"]["virtual_hosts"][0]["routes"]
    assert not any("decorator" in route for route in routes)


def test_endpoint_adds_the_tracer_its_cluster_and_span_names():
    bootstrap = render(GatewayConfig(otlp_endpoint="http://collector.internal:4317", otlp_service_name="gw"))
    provider = manager(bootstrap)["tracing"]["provider"]
    assert provider["name"] == "envoy.tracers.opentelemetry"
    assert provider["typed_config"]["service_name"] == "gw"
    assert provider["typed_config"]["grpc_service"]["envoy_grpc"]["cluster_name"] == COLLECTOR_CLUSTER
    [collector] = [c for c in bootstrap["static_resources"]["clusters"] if c["name"] == COLLECTOR_CLUSTER]
    address = collector["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
    assert address["socket_address"] == {"address": "collector.internal", "port_value": 4317}
    assert collector["type"] == "STRICT_DNS" and "transport_socket" not in collector
    routes = {route["name"]: route for route in manager(bootstrap)["route_config"]["virtual_hosts"][0]["routes"]}
    assert routes["Generate"]["decorator"] == {"operation": "POST /generate", "propagate": False}
    assert "tracing" not in routes["Generate"]
    for probe in ("Health", "Metrics"):  # probes and scrapes stay out of the trace store
        assert routes[probe]["tracing"] == {"overall_sampling": {"numerator": 0}}


def test_https_endpoint_uses_tls():
    bootstrap = render(GatewayConfig(otlp_endpoint="https://otel.example.com"))
    [collector] = [c for c in bootstrap["static_resources"]["clusters"] if c["name"] == COLLECTOR_CLUSTER]
    assert collector["transport_socket"]["typed_config"]["sni"] == "otel.example.com"


def test_bad_endpoint_is_refused():
    with pytest.raises(ValueError, match="otlp-endpoint"):
        GatewayConfig(otlp_endpoint="udp://collector:4317")


def test_envoy_accepts_the_traced_config(tmp_path):
    from gateway.envoy import GatewayError, envoy_binary

    try:
        binary = envoy_binary()
    except GatewayError as error:
        pytest.skip(str(error))
    path = tmp_path / "envoy.yaml"
    path.write_text(render_yaml(GatewayConfig(port=0, admin_port=0, otlp_endpoint="http://127.0.0.1:4317")))
    result = subprocess.run([binary, "--mode", "validate", "-c", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]
