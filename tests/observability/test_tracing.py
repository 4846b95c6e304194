"""Traces over gRPC into a real OTLP receiver: the caller's trace continues into the server span,
the engine spans hang under it with their attributes, and a dead collector never stops serving."""

from __future__ import annotations

import secrets
import socket
import subprocess
import sys
import time

import grpc
import pytest
from otlp_receiver import SERVICE

from inference_service.observability.tracing import SHUTDOWN_WAIT_S, otlp_target
from textgen.v1 import generate_pb2 as pb

TIMEOUT = 60
ENGINE_SPANS = {"validation", "queued", "inference"}
SERVER_KIND = 2  # opentelemetry.proto.trace.v1.Span.SpanKind.SPAN_KIND_SERVER


def request(max_new_tokens: int = 4, inputs: str = "the quick brown fox") -> pb.GenerateRequest:
    return pb.GenerateRequest(
        inputs=inputs, parameters=pb.GenerateParameters(max_new_tokens=max_new_tokens, details=True)
    )


def spans_of(server, receiver, trace_id: str, names: set[str]):
    server.server.observability.tracing.provider.force_flush()
    return receiver.wait_for(trace_id, names)


def check_engine_spans(spans, server_span, num_prompt_tokens: int, num_generated: int) -> None:
    validation, queued, inference = (spans[name][0] for name in ("validation", "queued", "inference"))
    for span in (validation, queued, inference):
        assert span.parent_span_id == server_span.span_id and span.service == SERVICE
        assert server_span.start_ns <= span.start_ns <= span.end_ns <= server_span.end_ns
    assert validation.end_ns <= queued.start_ns and queued.end_ns == inference.start_ns
    assert validation.attributes["gen_ai.usage.input_tokens"] == num_prompt_tokens
    attributes = inference.attributes
    assert attributes["gen_ai.usage.input_tokens"] == num_prompt_tokens
    assert attributes["gen_ai.usage.output_tokens"] == num_generated
    assert attributes["gen_ai.response.finish_reasons"] == ["length"]
    assert attributes["textgen.num_steps"] >= 1 and attributes["textgen.batch_sizes"] == [1]
    assert attributes["textgen.num_preemptions"] == 0
    assert attributes["gen_ai.usage.cache_read.input_tokens"] == 0  # shorter than a block: nothing reusable
    [(name, moment, _)] = inference.events
    assert name == "first_token" and inference.start_ns <= moment <= inference.end_ns


def num_prompt_tokens(server, inputs: str = "the quick brown fox") -> int:
    return len(server.stub.Tokenize(pb.GenerateRequest(inputs=inputs), timeout=TIMEOUT).tokens)


def test_generate_continues_the_callers_trace(traced_server, otlp_receiver, traceparent):
    trace_id, parent_id, header = traceparent
    response = traced_server.stub.Generate(request(), metadata=(("traceparent", header),), timeout=TIMEOUT)
    spans = spans_of(traced_server, otlp_receiver, trace_id, ENGINE_SPANS | {"/textgen.v1.TextGeneration/Generate"})
    [server_span] = spans["/textgen.v1.TextGeneration/Generate"]
    assert server_span.parent_span_id == parent_id and server_span.kind == SERVER_KIND
    assert server_span.service == SERVICE
    assert server_span.attributes["rpc.system"] == "grpc" and server_span.attributes["rpc.method"] == "Generate"
    check_engine_spans(spans, server_span, num_prompt_tokens(traced_server), response.details.generated_tokens)
    assert {span.name for span in otlp_receiver.trace(trace_id)} == ENGINE_SPANS | {server_span.name}


def test_stream_spans(traced_server, otlp_receiver, traceparent):
    trace_id, parent_id, header = traceparent
    # A prompt of its own: one sent before (by the unary test) would reuse its cached tokens.
    inputs = "a lazy dog sleeps"
    stream = traced_server.stub.GenerateStream(request(5, inputs), metadata=(("traceparent", header),), timeout=TIMEOUT)
    messages = list(stream)
    name = "/textgen.v1.TextGeneration/GenerateStream"
    spans = spans_of(traced_server, otlp_receiver, trace_id, ENGINE_SPANS | {name})
    [server_span] = spans[name]
    assert server_span.parent_span_id == parent_id
    num_prompt = num_prompt_tokens(traced_server, inputs)
    check_engine_spans(spans, server_span, num_prompt, messages[-1].details.generated_tokens)


def test_prompt_tokens_from_the_prefix_cache_mark_the_inference_span(traced_server, otlp_receiver):
    long = pb.GenerateRequest(inputs="birds sing " * 12, parameters=pb.GenerateParameters(max_new_tokens=2))
    num_tokens = len(traced_server.stub.Tokenize(long, timeout=TIMEOUT).tokens)
    block_size = traced_server.engine.info.block_size
    assert num_tokens > block_size
    for expected in (0, num_tokens - 1):  # cold, then every token but the last reused
        trace_id = secrets.token_hex(16)
        header = f"00-{trace_id}-{secrets.token_hex(8)}-01"
        traced_server.stub.Generate(long, metadata=(("traceparent", header),), timeout=TIMEOUT)
        [inference] = spans_of(traced_server, otlp_receiver, trace_id, {"inference"})["inference"]
        assert inference.attributes["gen_ai.usage.cache_read.input_tokens"] == expected


def test_validation_failure_is_an_error_span(traced_server, otlp_receiver, traceparent):
    trace_id, _, header = traceparent
    bad = pb.GenerateRequest(inputs="hello", parameters=pb.GenerateParameters(temperature=0.0))
    with pytest.raises(grpc.RpcError):
        traced_server.stub.Generate(bad, metadata=(("traceparent", header),), timeout=TIMEOUT)
    spans = spans_of(traced_server, otlp_receiver, trace_id, {"validation", "/textgen.v1.TextGeneration/Generate"})
    [server_span], [validation] = spans["/textgen.v1.TextGeneration/Generate"], spans["validation"]
    assert validation.parent_span_id == server_span.span_id
    assert validation.status_code == 2  # STATUS_CODE_ERROR
    # A caller's mistake leaves the server span's status unset (semantic conventions), with the code.
    assert server_span.attributes["rpc.grpc.status_code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "queued" not in spans and "inference" not in spans


def test_a_failure_during_generation_shows_where_it_happened(traced_server, otlp_receiver, traceparent, monkeypatch):
    trace_id, _, header = traceparent

    def broken_forward(*args, **kwargs):
        raise RuntimeError("device lost")

    # Scheduled, then its model step fails: queued ends, inference starts and ends in error.
    monkeypatch.setattr(traced_server.engine._engine.runner, "execute", broken_forward)
    with pytest.raises(grpc.RpcError) as raised:
        traced_server.stub.Generate(request(), metadata=(("traceparent", header),), timeout=TIMEOUT)
    assert raised.value.code() == grpc.StatusCode.INTERNAL
    spans = spans_of(traced_server, otlp_receiver, trace_id, ENGINE_SPANS | {"/textgen.v1.TextGeneration/Generate"})
    validation, queued, inference = (spans[name][0] for name in ("validation", "queued", "inference"))
    assert validation.status_code != 2 and queued.status_code != 2
    assert inference.status_code == 2  # STATUS_CODE_ERROR
    assert validation.end_ns <= queued.start_ns and queued.end_ns == inference.start_ns <= inference.end_ns
    assert "gen_ai.usage.output_tokens" not in inference.attributes


def test_without_a_caller_context_a_trace_starts_here(traced_server, otlp_receiver):
    before = {span.trace_id for span in otlp_receiver.spans}
    traced_server.stub.Generate(request(2), timeout=TIMEOUT)
    traced_server.server.observability.tracing.provider.force_flush()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        new = [s for s in otlp_receiver.spans if s.trace_id not in before and s.name.endswith("/Generate")]
        if new:
            break
        time.sleep(0.05)
    [root] = new
    assert root.parent_span_id == ""
    assert set(otlp_receiver.wait_for(root.trace_id, ENGINE_SPANS)) >= ENGINE_SPANS


def test_probes_and_scrapes_are_not_traced(traced_server, otlp_receiver, traceparent):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    metadata = (("traceparent", traceparent[2]),)
    health_pb2_grpc.HealthStub(traced_server.channel).Check(
        health_pb2.HealthCheckRequest(), metadata=metadata, timeout=TIMEOUT
    )
    traced_server.stub.Health(pb.HealthRequest(), metadata=metadata, timeout=TIMEOUT)
    traced_server.stub.Metrics(pb.MetricsRequest(), metadata=metadata, timeout=TIMEOUT)
    traced_server.stub.Info(pb.InfoRequest(), metadata=metadata, timeout=TIMEOUT)  # traced: proves the wait
    spans = spans_of(traced_server, otlp_receiver, traceparent[0], {"/textgen.v1.TextGeneration/Info"})
    assert set(spans) == {"/textgen.v1.TextGeneration/Info"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_serving_goes_on_when_the_collector_is_down(start_grpc_server, tiny_engine_config, traceparent):
    server = start_grpc_server(tiny_engine_config, otlp_endpoint=f"http://127.0.0.1:{free_port()}")
    for _ in range(3):
        response = server.stub.Generate(request(3), metadata=(("traceparent", traceparent[2]),), timeout=TIMEOUT)
        assert response.details.generated_tokens == 3
    assert len(list(server.stub.GenerateStream(request(3), timeout=TIMEOUT))) == 3
    started = time.monotonic()
    server.stop(timeout_s=1.0)
    assert time.monotonic() - started < SHUTDOWN_WAIT_S + 5  # the last export gives up in time


def test_tracing_off_loads_no_opentelemetry():
    code = (
        "import sys\n"
        "from inference_service.api.config import ServerConfig\n"
        "from inference_service.observability.hub import Observability\n"
        "observability = Observability(ServerConfig())\n"
        "assert observability.tracing is None and observability.server_interceptors() == []\n"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("endpoint", "target"),
    [
        ("http://collector:4317", ("collector", 4317, False)),
        ("collector:4318", ("collector", 4318, False)),
        ("https://otel.example.com", ("otel.example.com", 443, True)),
        ("http://[::1]:4317", ("::1", 4317, False)),
    ],
)
def test_otlp_endpoint_forms(endpoint, target):
    assert otlp_target(endpoint) == target


def test_bad_otlp_endpoint_is_a_config_error():
    from inference_service.api.config import ServerConfig

    with pytest.raises(ValueError, match="--otlp-endpoint"):
        ServerConfig(otlp_endpoint="ftp://collector")
