"""Health (grpc.health.v1 and the Health RPC) through loading, serving and draining; reflection."""

from __future__ import annotations

import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from inference_service.api import linger
from inference_service.api.errors import RETRYABLE_KEY
from textgen.v1 import generate_pb2 as pb

TIMEOUT = 30
SERVICE = "textgen.v1.TextGeneration"
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVING = health_pb2.HealthCheckResponse.SERVING
# The tiny model greedily generates from "a" to the length limit without an EOS.
LONG = pb.GenerateRequest(inputs="a", parameters=pb.GenerateParameters(max_new_tokens=400))
MEDIUM = pb.GenerateRequest(inputs="a", parameters=pb.GenerateParameters(max_new_tokens=150))


def health_of(server, names: tuple[str, ...] = ("", SERVICE)) -> tuple[int, ...]:
    """grpc.health.v1 status of the whole server and of the TextGeneration service."""
    stub = health_pb2_grpc.HealthStub(server.channel)
    return tuple(stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=TIMEOUT).status for name in names)


def unavailable(call) -> str:
    with pytest.raises(grpc.RpcError) as raised:
        call()
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
    assert dict(raised.value.trailing_metadata())["x-error-type"] == "unavailable"
    return raised.value.details()


def test_not_serving_while_loading_then_serving(start_grpc_server, tiny_engine_config):
    server = start_grpc_server(tiny_engine_config, load=False)
    assert health_of(server) == (NOT_SERVING, NOT_SERVING)
    assert health_of(server, ("liveness",)) == (SERVING,)  # alive while loading: no liveness restart
    assert unavailable(lambda: server.stub.Health(pb.HealthRequest(), timeout=TIMEOUT)) == (
        "the model is still loading"
    )
    unavailable(lambda: server.stub.Generate(LONG, timeout=TIMEOUT))
    unavailable(lambda: list(server.stub.GenerateStream(LONG, timeout=TIMEOUT)))

    server.load()
    assert health_of(server) == (SERVING, SERVING)
    assert server.stub.Health(pb.HealthRequest(), timeout=TIMEOUT).data == b""


def test_draining_is_not_serving_and_lets_in_flight_requests_finish(start_grpc_server, tiny_engine_config):
    server = start_grpc_server(tiny_engine_config)
    in_flight = server.stub.GenerateStream(MEDIUM, timeout=TIMEOUT)
    first = next(in_flight)
    shutdown = server.start_shutdown(timeout_s=30)

    assert health_of(server) == (NOT_SERVING, NOT_SERVING)
    assert health_of(server, ("liveness",)) == (SERVING,)  # alive while draining
    assert unavailable(lambda: server.stub.Health(pb.HealthRequest(), timeout=TIMEOUT)) == (
        "the server is shutting down"
    )
    assert unavailable(lambda: server.stub.Generate(LONG, timeout=TIMEOUT)) == "the server is shutting down"

    rest = list(in_flight)
    assert in_flight.code() == grpc.StatusCode.OK
    assert [first.index, *[m.index for m in rest]] == list(range(1, len(rest) + 2))
    assert rest[-1].HasField("generated_text") and rest[-1].index == 150
    shutdown.result(TIMEOUT)


def test_drain_timeout_cancels_what_is_left(start_grpc_server, tiny_engine_config):
    server = start_grpc_server(tiny_engine_config)
    in_flight = server.stub.GenerateStream(LONG, timeout=TIMEOUT)
    next(in_flight)
    server.start_shutdown(timeout_s=0.0).result(TIMEOUT)
    with pytest.raises(grpc.RpcError) as raised:
        list(in_flight)
    assert raised.value.code() == grpc.StatusCode.CANCELLED
    assert dict(raised.value.trailing_metadata())["x-error-type"] == "cancelled"


def test_a_stopping_server_refuses_what_still_comes_until_it_stops_coming(start_grpc_server, tiny_engine_config):
    """A gateway sends requests until its health checks see NOT_SERVING: each is refused, typed and
    marked retryable, while they come (the port would have cancelled them: nothing says whether a
    cancelled call ran); the server stops once they stop."""
    server = start_grpc_server(tiny_engine_config)
    assert server.stub.Generate(MEDIUM, timeout=TIMEOUT).generated_text  # requests are coming
    shutdown = server.start_shutdown(timeout_s=0.0)
    started, refusals = time.monotonic(), []
    while time.monotonic() - started < linger.QUIET_S + 1:  # longer than the quiet it waits for
        with pytest.raises(grpc.RpcError) as raised:
            server.stub.Generate(MEDIUM, timeout=TIMEOUT)
        refusals.append((raised.value.code(), dict(raised.value.trailing_metadata() or ()).get(RETRYABLE_KEY)))
        time.sleep(0.05)
    assert set(refusals) == {(grpc.StatusCode.UNAVAILABLE, "1")}, refusals
    assert not shutdown.done()
    shutdown.result(TIMEOUT)  # and it stops once they stop (tests/unit/test_linger.py: when)


def test_reflection_lists_and_describes_the_service(tiny_grpc_server):
    database = ProtoReflectionDescriptorDatabase(tiny_grpc_server.channel)
    assert {SERVICE, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= set(
        database.get_services()
    )
    service = database.FindFileContainingSymbol(SERVICE)
    assert service.name == "textgen/v1/generate.proto"
    assert "Generate" in [m.name for m in service.service[0].method]


def test_calls_while_loading_log_once_not_per_call(start_grpc_server, tiny_engine_config, caplog, monkeypatch):
    """Polling health every second, or Envoy retrying a request, while the model loads: one line."""
    import logging
    import re

    from inference_service.observability import logging as service_logging

    monkeypatch.setattr(service_logging, "_last_states", {})
    server = start_grpc_server(tiny_engine_config, load=False)
    with caplog.at_level(logging.DEBUG):
        for _ in range(5):
            unavailable(lambda: server.stub.Health(pb.HealthRequest(), timeout=TIMEOUT))
        for _ in range(3):
            unavailable(lambda: server.stub.Generate(LONG, timeout=TIMEOUT))
    loading = [r for r in caplog.records if re.search(r"still loading|failed \(unavailable\)", r.getMessage())]
    assert [r.levelno for r in loading].count(logging.INFO) == 1, [r.getMessage() for r in loading]
    assert len(loading) == 5 + 3 * 2  # each call still logged, at DEBUG: its failure and its request line
    server.load()
