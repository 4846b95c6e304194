"""TGI's SSE keep-alive through Envoy: a stream that waits (here queued behind a long request)
gets `:` comment frames, the events around them are unchanged, and TGI's client reads through."""

from __future__ import annotations

import dataclasses
import threading
import warnings

import pytest
from rest_helpers import sse_events

from inference_service.config import SchedulerConfig
from textgen.v1 import generate_pb2 as pb

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    import text_generation

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

INTERVAL_S = 0.05
LONG = pb.GenerateRequest(inputs="a", parameters=pb.GenerateParameters(max_new_tokens=400))
COMMENT = ":\n\n"


@pytest.fixture(scope="module")
def queued_gateway(tiny_engine_config, start_gateway):
    """One request per step, so a second request waits while a first one runs."""
    from tests.conftest import GrpcServerThread

    config = dataclasses.replace(tiny_engine_config, scheduler=SchedulerConfig(max_batch_size=1))
    server = GrpcServerThread(config)
    yield start_gateway(server, sse_keepalive_s=INTERVAL_S)
    server.stop(timeout_s=1.0)


def while_busy(gateway, call):
    """`call()` while a long request occupies the server's only batch slot."""
    first = gateway.server.stub.GenerateStream(LONG, timeout=60)
    next(first)
    done = threading.Thread(target=lambda: list(first))
    done.start()
    try:
        return call()
    finally:
        done.join(60)


def test_a_waiting_stream_gets_keepalive_comments(queued_gateway):
    body = while_busy(
        queued_gateway,
        lambda: queued_gateway.curl(
            "/generate_stream", "-N", body={"inputs": "b", "parameters": {"max_new_tokens": 3}}
        ),
    )
    assert body.startswith(COMMENT + COMMENT)  # several intervals passed before the first token
    events = sse_events(body.replace(COMMENT, ""))
    assert [e["index"] for e in events] == [1, 2, 3]
    assert events[-1]["generated_text"] is not None and all("keep_alive" not in e for e in events)


def test_tgi_client_reads_through_the_comments(queued_gateway):
    client = text_generation.Client(queued_gateway.url, timeout=60)
    events = while_busy(queued_gateway, lambda: list(client.generate_stream("b", max_new_tokens=3)))
    assert len(events) == 3 and events[-1].generated_text is not None
