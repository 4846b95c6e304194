"""Heartbeats over real gRPC: a stream that waits in the queue gets `keep_alive` messages when the
caller asks with the header (as the REST gateway does), and none otherwise."""

from __future__ import annotations

import dataclasses
import threading

import pytest

from inference_service.api.keepalive import KEEPALIVE_KEY
from inference_service.config import SchedulerConfig
from textgen.v1 import generate_pb2 as pb

TIMEOUT = 60
# The tiny model greedily generates from "a" to the length limit without an EOS: a long request.
LONG = pb.GenerateRequest(inputs="a", parameters=pb.GenerateParameters(max_new_tokens=400))
SHORT = pb.GenerateRequest(inputs="b", parameters=pb.GenerateParameters(max_new_tokens=3))


@pytest.fixture
def one_at_a_time(start_grpc_server, tiny_engine_config):
    """A server that runs one request per step: a second request waits for the first to finish."""
    return start_grpc_server(dataclasses.replace(tiny_engine_config, scheduler=SchedulerConfig(max_batch_size=1)))


def queued_stream(server, metadata=()) -> list[pb.StreamResponse]:
    first = server.stub.GenerateStream(LONG, timeout=TIMEOUT)
    next(first)  # running: the next request queues behind it
    done = threading.Thread(target=lambda: list(first))
    done.start()
    try:
        return list(server.stub.GenerateStream(SHORT, timeout=TIMEOUT, metadata=metadata))
    finally:
        done.join(TIMEOUT)


def test_a_queued_stream_gets_heartbeats_when_asked(one_at_a_time):
    messages = queued_stream(one_at_a_time, metadata=((KEEPALIVE_KEY, "0.05"),))
    heartbeats = [m for m in messages if m.HasField("keep_alive")]
    tokens = [m for m in messages if not m.HasField("keep_alive")]
    assert heartbeats and all(m == pb.StreamResponse(keep_alive=True) for m in heartbeats)
    assert messages.index(tokens[0]) > 0  # they came while it waited
    assert [m.index for m in tokens] == [1, 2, 3] and tokens[-1].HasField("generated_text")


def test_no_heartbeat_unless_asked(one_at_a_time):
    messages = queued_stream(one_at_a_time)
    assert [m.index for m in messages] == [1, 2, 3]
    assert not any(m.HasField("keep_alive") for m in messages)
