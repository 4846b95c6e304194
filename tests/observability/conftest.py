"""Fixtures: a real OTLP/gRPC receiver, and helpers to read spans and metrics."""

from __future__ import annotations

import secrets

import pytest
from otlp_receiver import OtlpReceiver


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
