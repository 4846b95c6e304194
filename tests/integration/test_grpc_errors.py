"""Each error kind over the wire: status code, TGI's message, ErrorInfo, and freed KV blocks."""

from __future__ import annotations

import dataclasses

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

from inference_service.config import LimitsConfig
from textgen.v1 import generate_pb2 as pb

TIMEOUT = 60
# The tiny model greedily generates from "a" to the length limit without an EOS: a long request.
LONG = pb.GenerateRequest(inputs="a", parameters=pb.GenerateParameters(max_new_tokens=400))
INBAND = (("x-textgen-inband-errors", "1"),)


def error_info(error: grpc.RpcError) -> tuple[str, str]:
    """(x-error-type trailer, ErrorInfo.reason) of a failed call; also checks the ErrorInfo domain."""
    trailers = dict(error.trailing_metadata())
    status = status_pb2.Status.FromString(trailers["grpc-status-details-bin"])
    assert status.code == error.code().value[0] and status.message == error.details()
    info = error_details_pb2.ErrorInfo()
    assert status.details[0].Unpack(info) and info.domain == "textgen.v1"
    return trailers["x-error-type"], info.reason


def invalid_request() -> pb.GenerateRequest:
    return pb.GenerateRequest(inputs="hello", parameters=pb.GenerateParameters(temperature=0.0))


def test_validation_error_is_invalid_argument_with_tgi_message(tiny_grpc_server):
    with pytest.raises(grpc.RpcError) as raised:
        tiny_grpc_server.stub.Generate(invalid_request(), timeout=TIMEOUT)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert raised.value.details() == "Input validation error: `temperature` must be strictly positive"
    assert error_info(raised.value) == ("validation", "validation")


def test_stream_validation_error(tiny_grpc_server):
    request = pb.GenerateRequest(inputs="hello", parameters=pb.GenerateParameters(best_of=2, do_sample=True))
    with pytest.raises(grpc.RpcError) as raised:
        list(tiny_grpc_server.stub.GenerateStream(request, timeout=TIMEOUT))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert raised.value.details() == "Input validation error: `best_of` != 1 is not supported when streaming tokens"


def test_inband_stream_error_is_a_last_message_and_ok(tiny_grpc_server):
    call = tiny_grpc_server.stub.GenerateStream(invalid_request(), timeout=TIMEOUT, metadata=INBAND)
    messages = list(call)
    assert call.code() == grpc.StatusCode.OK
    assert [(m.error, m.error_type) for m in messages] == [
        ("Input validation error: `temperature` must be strictly positive", "validation")
    ]


def test_too_long_prompt(tiny_grpc_server):
    request = pb.GenerateRequest(inputs="a " * 600, parameters=pb.GenerateParameters(max_new_tokens=1))
    with pytest.raises(grpc.RpcError) as raised:
        tiny_grpc_server.stub.Generate(request, timeout=TIMEOUT)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "`inputs` tokens + `max_new_tokens` must be <= 512" in raised.value.details()


def test_client_cancel_mid_stream_frees_its_blocks(tiny_grpc_server):
    call = tiny_grpc_server.stub.GenerateStream(LONG, timeout=TIMEOUT)
    for _ in range(3):
        next(call)
    busy = tiny_grpc_server.stats()
    assert busy.num_running == 1 and busy.num_free_blocks < busy.num_total_blocks
    call.cancel()
    stats = tiny_grpc_server.wait_idle()
    assert (stats.num_running, stats.num_waiting, stats.num_free_blocks) == (0, 0, stats.num_total_blocks)


def test_deadline_aborts_the_request_and_frees_its_blocks(tiny_grpc_server):
    with pytest.raises(grpc.RpcError) as raised:  # LONG takes a few times longer than this here
        tiny_grpc_server.stub.Generate(LONG, timeout=0.1)
    assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    stats = tiny_grpc_server.wait_idle()
    assert (stats.num_running, stats.num_waiting, stats.num_free_blocks) == (0, 0, stats.num_total_blocks)


def test_one_of_two_calls_is_overloaded(start_grpc_server, tiny_engine_config):
    config = dataclasses.replace(
        tiny_engine_config,
        limits=LimitsConfig(max_total_tokens=tiny_engine_config.limits.max_total_tokens, max_concurrent_requests=1),
    )
    server = start_grpc_server(config)
    first = server.stub.GenerateStream(LONG, timeout=TIMEOUT)
    next(first)  # admitted and running
    with pytest.raises(grpc.RpcError) as raised:
        server.stub.Generate(LONG, timeout=TIMEOUT)
    assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert raised.value.details() == "Model is overloaded"
    assert error_info(raised.value) == ("overloaded", "overloaded")
    assert list(first)[-1].HasField("generated_text")  # the first call completed


def test_failure_inside_generation_is_internal(start_grpc_server, tiny_engine_config, monkeypatch):
    server = start_grpc_server(tiny_engine_config)

    def broken_step():
        raise RuntimeError("device lost")

    # The engine thread's model step fails: every running request ends with a generation error.
    monkeypatch.setattr(server.engine._engine, "step", broken_step)
    with pytest.raises(grpc.RpcError) as raised:
        server.stub.Generate(LONG, timeout=TIMEOUT)
    assert raised.value.code() == grpc.StatusCode.INTERNAL
    # What failed inside stays in the server's log: the caller learns that generation failed.
    assert raised.value.details() == "Request failed during generation: Server error: the engine failed"
    assert error_info(raised.value) == ("generation", "generation")

    call = server.stub.GenerateStream(LONG, timeout=TIMEOUT, metadata=INBAND)
    [message] = list(call)
    assert call.code() == grpc.StatusCode.OK and message.error_type == "generation"


def test_a_bug_is_unknown_not_internal(tiny_grpc_server, monkeypatch):
    async def broken_validate(request, *, stream):
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(tiny_grpc_server.front_end, "validate", broken_validate)
    with pytest.raises(grpc.RpcError) as raised:
        tiny_grpc_server.stub.Generate(LONG, timeout=TIMEOUT)
    assert raised.value.code() == grpc.StatusCode.UNKNOWN
    assert raised.value.details() == "Unexpected server error"  # the exception is in the log, not sent
    assert error_info(raised.value) == ("internal", "internal")


def test_payload_limit_caps_request_size(start_grpc_server, tiny_engine_config):
    server = start_grpc_server(tiny_engine_config, load=False, payload_limit=1000)
    with pytest.raises(grpc.RpcError) as raised:
        server.stub.Generate(pb.GenerateRequest(inputs="x" * 5000), timeout=TIMEOUT)
    assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    with pytest.raises(grpc.RpcError) as small:  # a small one reaches the servicer (still loading)
        server.stub.Generate(pb.GenerateRequest(inputs="x" * 500), timeout=TIMEOUT)
    assert small.value.code() == grpc.StatusCode.UNAVAILABLE
