"""A REST client that goes away cancels its request in the engine; a full server answers 429 (or an
in-band `overloaded` event on streams), which TGI's client raises as OverloadedError."""

from __future__ import annotations

import dataclasses
import http.client
import json
import time
import warnings
from urllib.parse import urlsplit

import pytest

from textgen.v1 import generate_pb2 as pb

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    import text_generation

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

# On the tiny model this prompt runs to max_new_tokens without meeting EOS (checked by `long_prompt`).
LONG_PROMPT = "hello"
LONG_RUN = 480
GUARD_TOKENS = 100


@pytest.fixture(scope="module")
def long_prompt(tiny_grpc_server):
    request = pb.GenerateRequest(
        inputs=LONG_PROMPT, parameters=pb.GenerateParameters(max_new_tokens=GUARD_TOKENS, details=True)
    )
    details = tiny_grpc_server.stub.Generate(request, timeout=120).details
    assert details.finish_reason == "length", "the long prompt must not end early for these tests to mean anything"
    return LONG_PROMPT


def open_stream(url: str, path: str, body: dict) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    """POST and return once the first SSE event arrived (the request is admitted and generating)."""
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    connection.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200
    first = response.readline()
    assert first.startswith(b'data: {"index":1'), first
    return connection, response


@pytest.mark.parametrize("path", ["/generate_stream", "/generate"])
def test_client_disconnect_cancels_the_request(gateway, long_prompt, path):
    server = gateway.server
    steps_before = server.wait_idle().num_steps
    body = {"inputs": long_prompt, "parameters": {"max_new_tokens": LONG_RUN}}
    parts = urlsplit(gateway.url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    connection.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    if path == "/generate_stream":
        response = connection.getresponse()
        for _ in range(3):
            assert response.readline().startswith(b"data: ")
            response.readline()
    else:  # wait until the engine runs it, then go away without reading the answer
        deadline = time.monotonic() + 15
        while server.stats().num_running == 0:
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.01)
    connection.sock.close()
    connection.close()

    stats = server.wait_idle(timeout=15)
    assert (stats.num_running, stats.num_waiting) == (0, 0)
    assert stats.num_free_blocks == stats.num_total_blocks
    assert stats.num_steps - steps_before < GUARD_TOKENS  # it stopped, it did not run to the end


@pytest.fixture
def one_slot_gateway(tiny_engine_config, start_grpc_server, start_gateway):
    """A server that admits one request at a time (--max-concurrent-requests 1), behind Envoy."""
    limits = dataclasses.replace(tiny_engine_config.limits, max_concurrent_requests=1)
    return start_gateway(start_grpc_server(dataclasses.replace(tiny_engine_config, limits=limits)))


def test_overloaded(one_slot_gateway, long_prompt):
    gateway = one_slot_gateway
    connection, _ = open_stream(
        gateway.url, "/generate_stream", {"inputs": long_prompt, "parameters": {"max_new_tokens": LONG_RUN}}
    )
    try:
        client = text_generation.Client(gateway.url, timeout=60)
        with pytest.raises(text_generation.errors.OverloadedError, match="overloaded"):
            client.generate("another prompt", max_new_tokens=2)
        with pytest.raises(text_generation.errors.OverloadedError, match="overloaded"):
            list(client.generate_stream("another prompt", max_new_tokens=2))
        status, body = _post(gateway.url, "/generate", {"inputs": "x", "parameters": {"max_new_tokens": 2}})
        assert (status, body["error_type"]) == (429, "overloaded")
    finally:
        connection.sock.close()
        connection.close()
    gateway.server.wait_idle(timeout=15)
    assert client.generate("another prompt", max_new_tokens=2).generated_text is not None


def _post(url: str, path: str, body: dict) -> tuple[int, dict]:
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    try:
        connection.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()
