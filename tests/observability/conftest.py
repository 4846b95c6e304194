"""Fixtures: a real OTLP/gRPC receiver, and helpers to read spans and metrics."""

from __future__ import annotations

import secrets

import pytest
from otlp_receiver import SERVICE, OtlpReceiver


@pytest.fixture(scope="module")
def otlp_receiver():
    receiver = OtlpReceiver()
    yield receiver
    receiver.stop()


@pytest.fixture
def traceparent():
    """A fresh caller context: (trace id, parent span id, `traceparent` value), sampled."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, span_id, f"00-{trace_id}-{span_id}-01"


@pytest.fixture(scope="module")
def traced_server(tiny_engine_config, otlp_receiver):
    """A tiny-model server exporting its traces to the module's receiver as `SERVICE`."""
    from tests.conftest import GrpcServerThread

    server = GrpcServerThread(tiny_engine_config, otlp_endpoint=otlp_receiver.endpoint, otlp_service_name=SERVICE)
    yield server
    server.stop(timeout_s=1.0)
