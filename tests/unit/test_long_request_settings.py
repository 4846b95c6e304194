"""What lets a long request finish once, as configured: every hop's keepalive pings are ones its
server permits, no gateway timeout cuts a silent unary request, and only refusals before admission
carry the retry marker (the real hops run in tests/e2e/test_long_requests.py)."""

from __future__ import annotations

import grpc
import pytest

from gateway.__main__ import DEPLOY_CONFIG
from gateway.config import GatewayConfig, render
from inference_service import errors
from inference_service.api import pings
from inference_service.api.config import ServerConfig
from inference_service.api.errors import RETRYABLE_KEY, trailing_metadata
from textgen_client import _channel
from textgen_client import errors as client_errors


def _seconds(duration: str) -> float:
    assert duration.endswith("s"), duration
    return float(duration[:-1])


def _manager(config: GatewayConfig) -> dict:
    return render(config)["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]


def _engine_keepalive(config: GatewayConfig) -> dict:
    (cluster,) = [c for c in render(config)["static_resources"]["clusters"] if c["name"] == "textgen"]
    options = cluster["typed_extension_protocol_options"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
    return options["explicit_http_config"]["http2_protocol_options"]["connection_keepalive"]


@pytest.mark.parametrize("config", [DEPLOY_CONFIG, GatewayConfig(upstream_ports=(1, 2)), GatewayConfig()])
def test_envoy_pings_the_engine_no_more_often_than_it_permits(config):
    keepalive = _engine_keepalive(config)
    # Envoy's jitter only adds to the interval; the engine permits pings three times as often.
    assert "interval_jitter" not in keepalive
    assert _seconds(keepalive["interval"]) == pings.PING_INTERVAL_S >= 2 * ServerConfig().min_ping_interval_s
    assert _seconds(keepalive["timeout"]) == pings.PING_TIMEOUT_S


def test_the_engine_permits_those_pings_busy_or_idle():
    options = dict(pings.server_options(ServerConfig().min_ping_interval_s))
    assert options["grpc.http2.min_ping_interval_without_data_ms"] == pings.MIN_PING_INTERVAL_S * 1000
    assert options["grpc.keepalive_permit_without_calls"] == 1  # Envoy pings its idle pooled connections too
    assert dict(pings.server_options(0.05))["grpc.http2.min_ping_interval_without_data_ms"] == 50


def test_the_typed_client_pings_as_the_server_permits():
    options = dict(_channel.KEEPALIVE_OPTIONS)
    assert options["grpc.keepalive_time_ms"] == pings.PING_INTERVAL_S * 1000
    assert options["grpc.keepalive_time_ms"] >= 2 * pings.MIN_PING_INTERVAL_S * 1000
    assert options["grpc.keepalive_timeout_ms"] == pings.PING_TIMEOUT_S * 1000
    assert options["grpc.http2.max_pings_without_data"] == 0  # keeps pinging through a silent call
    target = _channel.parse_target("localhost:1")
    assert set(_channel.KEEPALIVE_OPTIONS) <= set(_channel.channel_options(target, None))
    assert client_errors.RETRYABLE_KEY == RETRYABLE_KEY


def test_no_gateway_timeout_cuts_a_silent_request():
    manager = _manager(DEPLOY_CONFIG)
    assert manager["stream_idle_timeout"] == "0s"
    assert _seconds(manager.get("max_stream_duration", "0s")) == 0
    # Envoy's request_timeout bounds how long a caller takes to *send* its request (a slow-client
    # guard); it is disarmed once the request has gone upstream or the answer has begun.
    assert _seconds(manager["request_timeout"]) > 0
    assert "max_stream_duration" not in manager.get("common_http_protocol_options", {})
    routes = manager["route_config"]["virtual_hosts"][0]["routes"]
    to_engine = [r["route"] for r in routes if "route" in r and r["name"] != "preflight"]
    assert to_engine and all(r["timeout"] == r["idle_timeout"] == "0s" for r in to_engine)


def test_only_refusals_before_admission_are_retryable():
    retryable = {cls for cls in _subclasses(errors.InferenceError) if cls.retryable}
    assert retryable == {errors.OverloadedError, errors.UnavailableError}
    marked = dict(trailing_metadata(grpc.StatusCode.UNAVAILABLE, "loading", "unavailable", retryable=True))
    assert marked[RETRYABLE_KEY] == "1"
    assert RETRYABLE_KEY not in dict(trailing_metadata(grpc.StatusCode.INTERNAL, "boom", "generation"))


def test_envoys_own_503_is_marked_only_when_no_engine_was_reached():
    mappers = _manager(DEPLOY_CONFIG)["local_reply_config"]["mappers"]
    marked = [m for m in mappers if m.get("headers_to_add")]
    assert len(marked) == 3  # TGI's, OpenAI's and Anthropic's shape
    for mapper in marked:
        filters = mapper["filter"]["and_filter"]["filters"]
        assert {"response_flag_filter": {"flags": ["UF", "UH"]}} in filters
        assert [h["header"] for h in mapper["headers_to_add"]] == [{"key": RETRYABLE_KEY, "value": "1"}]


def test_the_client_retries_only_what_no_server_took():
    from textgen_client._retry import is_retryable

    unavailable = grpc.StatusCode.UNAVAILABLE
    refused = client_errors.from_status(unavailable, "loading", ((RETRYABLE_KEY, "1"),))
    unreachable = client_errors.from_status(unavailable, "failed to connect to all addresses; last error: ...")
    cut = client_errors.from_status(unavailable, "Too many pings")  # a connection closed under a running call
    assert is_retryable(refused, received_any=False) and is_retryable(unreachable, received_any=False)
    assert not is_retryable(cut, received_any=False)
    assert not is_retryable(refused, received_any=True)


def _subclasses(cls: type) -> set[type]:
    return {cls, *(s for sub in cls.__subclasses__() for s in _subclasses(sub))}
