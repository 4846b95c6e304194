"""What Envoy accepts from callers, as rendered (gateway/limits.py): timeouts for requests that
arrive slowly but none for answers, per-connection stream limits, header limits inside the
engine's, a connection cap inside Envoy's descriptor limit, and /health tried on every replica."""

from __future__ import annotations

import pytest

from gateway.config import GatewayConfig, render
from gateway.limits import MIN_RESERVED_FILES, connections_within
from inference_service.api import header_limits


def _manager(config: GatewayConfig) -> dict:
    listener = render(config)["static_resources"]["listeners"][0]
    return listener["filter_chains"][0]["filters"][0]["typed_config"]


def _routes(config: GatewayConfig) -> dict[str, dict]:
    return {r["name"]: r for r in _manager(config)["route_config"]["virtual_hosts"][0]["routes"]}


def test_slow_requests_time_out_but_answers_never_do():
    config = GatewayConfig(request_headers_timeout_s=2.5, request_timeout_s=30, idle_timeout_s=45)
    manager = _manager(config)
    assert manager["request_headers_timeout"] == "2.5s" and manager["request_timeout"] == "30s"
    assert manager["common_http_protocol_options"]["idle_timeout"] == "45s"
    # A unary generation is silent until it answers, minutes later: no idle or overall timeout on
    # any route to the engine.
    engine_routes = [r for r in _routes(config).values() if "cluster" in r.get("route", {})]
    assert engine_routes and all(
        r["route"].get("timeout", "0s") == "0s" for r in engine_routes if r["name"] != "preflight"
    )
    assert all(r["route"]["idle_timeout"] == "0s" for r in engine_routes if r["name"] not in ("preflight", "Health"))
    assert "max_stream_duration" not in manager["common_http_protocol_options"]


def test_streams_per_connection_and_protocol_errors_stay_per_stream():
    manager = _manager(GatewayConfig(max_concurrent_streams=64))
    assert manager["http2_protocol_options"] == {
        "max_concurrent_streams": 64,
        "override_stream_error_on_invalid_http_message": True,
    }
    (cluster,) = [c for c in render(GatewayConfig())["static_resources"]["clusters"] if c["name"] == "textgen"]
    options = cluster["typed_extension_protocol_options"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
    upstream = options["explicit_http_config"]["http2_protocol_options"]
    assert upstream["override_stream_error_on_invalid_http_message"] is True
    assert "connection_keepalive" in upstream  # kept beside it


def test_what_envoy_forwards_fits_the_engines_metadata_limit():
    manager = _manager(GatewayConfig())
    assert manager["max_request_headers_kb"] == header_limits.GATEWAY_MAX_REQUEST_HEADERS_KB
    assert manager["common_http_protocol_options"]["max_headers_count"] == header_limits.GATEWAY_MAX_HEADERS_COUNT
    forwarded = (
        header_limits.GATEWAY_MAX_REQUEST_HEADERS_KB * 1024
        + header_limits.GATEWAY_MAX_HEADERS_COUNT * header_limits.GRPC_BYTES_PER_ENTRY
    )
    assert forwarded + 4096 < header_limits.MAX_METADATA_BYTES  # room for what Envoy adds
    assert dict(header_limits.metadata_options()) == {
        "grpc.max_metadata_size": header_limits.MAX_METADATA_BYTES,
        "grpc.absolute_max_metadata_size": header_limits.MAX_METADATA_BYTES,  # no refusals at random
    }


@pytest.mark.parametrize("open_files", [64, 1024, 20_000, 1 << 20])
def test_the_connection_cap_leaves_descriptors_for_the_engine(open_files):
    cap = connections_within(open_files)
    assert 1 <= cap < open_files
    assert open_files - cap >= min(MIN_RESERVED_FILES, open_files // 2)


def test_the_overload_manager_caps_connections_at_the_configured_number():
    (monitor,) = render(GatewayConfig(max_connections=1234))["overload_manager"]["resource_monitors"]
    assert monitor["typed_config"]["max_active_downstream_connections"] == 1234


def test_envoy_gets_a_cap_within_its_open_file_limit(tmp_path):
    from gateway.envoy import Envoy, GatewayError, open_files_limit

    try:
        envoy = Envoy(GatewayConfig(max_connections=50_000), tmp_path, open_files=1000)
        unlimited = Envoy(GatewayConfig(max_connections=50_000), tmp_path)
    except GatewayError as error:
        pytest.skip(str(error))
    assert envoy.open_files == 1000 and envoy.config.max_connections == connections_within(1000)
    assert unlimited.open_files == open_files_limit()
    assert unlimited.config.max_connections == min(50_000, connections_within(open_files_limit()))


def test_health_is_tried_on_every_replica_and_generations_are_not_replayed():
    routes = _routes(GatewayConfig(upstream_ports=(7001, 7002)))
    health = routes["Health"]["route"]["retry_policy"]
    assert {"reset", "connect-failure", "unavailable"} <= set(health["retry_on"].split(","))
    assert health["num_retries"] >= 1 and health["per_try_timeout"]
    assert "reset" not in routes["Generate"]["route"]["retry_policy"]["retry_on"].split(",")


@pytest.mark.parametrize(
    "values",
    [{"max_connections": 0}, {"max_concurrent_streams": 0}, {"request_headers_timeout_s": 0}, {"idle_timeout_s": -1}],
)
def test_bad_limits_are_refused(values):
    with pytest.raises(ValueError):
        GatewayConfig(**values)


def test_rest_bodies_are_whole_before_they_go_upstream_and_grpc_streams_through():
    manager = _manager(GatewayConfig(payload_limit=1000))
    names = [f["name"] for f in manager["http_filters"]]
    assert names.index("envoy.filters.http.buffer") < names.index("envoy.filters.http.grpc_json_transcoder")
    (buffer,) = [f for f in manager["http_filters"] if f["name"] == "envoy.filters.http.buffer"]
    assert buffer["typed_config"]["max_request_bytes"] > 1000  # the transcoder answers the payload limit's 413
    routes = _routes(GatewayConfig())
    assert routes["grpc"]["typed_per_filter_config"]["envoy.filters.http.buffer"]["disabled"] is True
    assert "typed_per_filter_config" not in routes["Generate"]
