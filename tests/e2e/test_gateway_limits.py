"""The gateway's own behaviour: body size limit (413 JSON), CORS, health while the model loads and
when the server is gone, and gRPC errors that arrive before any message."""

from __future__ import annotations

import json

import pytest
from rest_helpers import sse_events, status_and_body

PAYLOAD_LIMIT = 4096


@pytest.fixture(scope="module")
def limited(tiny_grpc_server, start_gateway):
    return start_gateway(tiny_grpc_server, payload_limit=PAYLOAD_LIMIT, cors_allow_origin=("https://app.example",))


@pytest.mark.parametrize("path", ["/generate", "/", "/generate_stream"])
def test_bodies_over_the_payload_limit_get_413_json(limited, validate, path):
    body = {"inputs": "x" * PAYLOAD_LIMIT, "parameters": {"max_new_tokens": 1}}
    status, headers, raw = status_and_body(limited.curl(path, "-i", body=body))
    error = json.loads(raw)
    validate(error, "ErrorResponse")
    assert (status, error["error_type"]) == (413, "payload_too_large")
    assert headers["content-type"] == "application/json"


def test_the_limit_is_on_requests_not_answers(limited):
    inputs = "the quick brown fox " * (PAYLOAD_LIMIT // 25)
    answer = limited.curl("/tokenize", body={"inputs": inputs})
    assert len(answer) > PAYLOAD_LIMIT and len(json.loads(answer)) > 100


def test_cors_allows_the_configured_origin_only(limited):
    preflight = (
        "-X",
        "OPTIONS",
        "-H",
        "Access-Control-Request-Method: POST",
        "-H",
        "Access-Control-Request-Headers: content-type",
    )
    _, headers, _ = status_and_body(limited.curl("/generate", "-i", *preflight, "-H", "Origin: https://app.example"))
    assert headers["access-control-allow-origin"] == "https://app.example"
    assert "POST" in headers["access-control-allow-methods"]
    _, headers, _ = status_and_body(limited.curl("/generate", "-i", *preflight, "-H", "Origin: https://evil.example"))
    assert "access-control-allow-origin" not in headers
    _, headers, _ = status_and_body(limited.curl("/info", "-i", "-H", "Origin: https://app.example"))
    assert headers["access-control-allow-origin"] == "https://app.example"


def test_cors_allows_any_origin_by_default(gateway):
    _, headers, _ = status_and_body(gateway.curl("/info", "-i", "-H", "Origin: https://anywhere.example"))
    assert headers["access-control-allow-origin"] == "https://anywhere.example"


def test_while_the_model_loads(tiny_engine_config, start_grpc_server, start_gateway, validate):
    """Before the engine is attached every RPC answers UNAVAILABLE: REST gets TGI's 503 shapes."""
    loading = start_gateway(start_grpc_server(tiny_engine_config, load=False))
    status, _, body = status_and_body(loading.curl("/health", "-i"))
    assert (status, json.loads(body)) == (503, {"error": "unhealthy", "error_type": "healthcheck"})
    status, _, body = status_and_body(loading.curl("/generate", "-i", body={"inputs": "x"}))
    error = json.loads(body)
    validate(error, "ErrorResponse")
    assert (status, error["error_type"]) == (503, "unavailable")
    status, _, body = status_and_body(loading.curl("/generate_stream", "-i", body={"inputs": "x"}))
    [event] = sse_events(body)
    assert status == 200 and event["error_type"] == "unavailable"


def test_when_the_server_is_gone(tiny_engine_config, start_grpc_server, start_gateway, validate):
    server = start_grpc_server(tiny_engine_config, load=False)
    orphan = start_gateway(server)
    server.stop(timeout_s=0)
    status, _, body = status_and_body(orphan.curl("/health", "-i"))
    assert (status, json.loads(body)) == (503, {"error": "unhealthy", "error_type": "healthcheck"})
    status, _, body = status_and_body(orphan.curl("/generate", "-i", body={"inputs": "x"}))
    error = json.loads(body)
    validate(error, "ErrorResponse")
    assert (status, error["error_type"]) == (503, "unavailable")
