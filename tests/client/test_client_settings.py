"""Targets, channel options, retry pacing and trace context (no server)."""

from __future__ import annotations

import json

import pytest

from textgen_client import OverloadedError, RetryPolicy, UnavailableError
from textgen_client._channel import channel_options, parse_target
from textgen_client._retry import is_retryable
from textgen_client._tracing import trace_metadata


@pytest.mark.parametrize(
    ("target", "address", "tls", "balanced"),
    [
        ("localhost:50051", "localhost:50051", False, False),
        ("dns:///textgen.internal:50051", "dns:///textgen.internal:50051", False, True),
        ("ipv4:10.0.0.1:80,10.0.0.2:80", "ipv4:10.0.0.1:80,10.0.0.2:80", False, True),
        ("unix:/tmp/textgen.sock", "unix:/tmp/textgen.sock", False, False),
        ("http://host:8080", "host:8080", False, False),
        ("https://api.example.com", "api.example.com:443", True, False),
        ("https://[::1]:9000/", "[::1]:9000", True, False),
    ],
)
def test_targets(target, address, tls, balanced):
    parsed = parse_target(target)
    assert (parsed.address, parsed.tls, parsed.balanced) == (address, tls, balanced)


def test_empty_target_is_refused():
    with pytest.raises(ValueError):
        parse_target("  ")


def _policy(options) -> list:
    configs = [json.loads(value) for name, value in options if name == "grpc.service_config"]
    return [next(iter(c["loadBalancingConfig"][0])) for c in configs]


def test_several_replicas_are_balanced_round_robin():
    assert _policy(channel_options(parse_target("dns:///svc:1"), None)) == ["round_robin"]
    assert _policy(channel_options(parse_target("localhost:1"), None)) == []
    assert _policy(channel_options(parse_target("localhost:1"), "round_robin")) == ["round_robin"]
    extra = (("grpc.max_receive_message_length", 5), ("grpc.keepalive_time_ms", 1000))
    options = channel_options(parse_target("localhost:1"), None, extra)
    assert len(dict(options)) == len(options)  # one of each: gRPC would take the first, ours
    assert dict(options)["grpc.max_receive_message_length"] == 5 and dict(options)["grpc.keepalive_time_ms"] == 1000
    assert dict(options)["grpc.max_reconnect_backoff_ms"] <= 2000


def test_backoff_grows_to_its_cap():
    policy = RetryPolicy(initial_backoff=0.1, max_backoff=1.0, multiplier=2.0, jitter=0.0)
    assert [policy.backoff(i) for i in range(6)] == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0, 1.0])
    jittered = RetryPolicy(initial_backoff=1.0, max_backoff=1.0, jitter=0.2)
    assert all(0.8 <= jittered.backoff(0) <= 1.2 for _ in range(50))


@pytest.mark.parametrize(
    "bad",
    [
        {"max_retries": -1},
        {"initial_backoff": 0},
        {"initial_backoff": 3, "max_backoff": 1},
        {"multiplier": 0.5},
        {"jitter": 1.0},
    ],
)
def test_bad_policies(bad):
    with pytest.raises(ValueError):
        RetryPolicy(**bad)


def test_only_unavailable_that_no_server_took_before_any_token_is_retried():
    unavailable = UnavailableError("down", "unavailable", retryable=True)
    assert is_retryable(unavailable, received_any=False)
    assert not is_retryable(unavailable, received_any=True)
    assert not is_retryable(UnavailableError("connection lost", "unavailable"), received_any=False)
    assert not is_retryable(OverloadedError("busy", "overloaded", retryable=True), received_any=False)


def test_trace_context_of_the_current_span():
    from opentelemetry.sdk.trace import TracerProvider

    tracer = TracerProvider().get_tracer("test")
    assert trace_metadata() == []  # no span: nothing to send
    with tracer.start_as_current_span("caller") as span:
        metadata = dict(trace_metadata())
    context = span.get_span_context()
    assert metadata["traceparent"].startswith(f"00-{context.trace_id:032x}-{context.span_id:016x}-")
