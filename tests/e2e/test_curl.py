"""TGI's documented `curl` calls through Envoy; every body is checked against TGI's OpenAPI schema."""

from __future__ import annotations

import json
import re
import time

import pytest
from rest_helpers import sse_events, status_and_body

PROMPT = "What is Deep Learning?"


def test_generate(gateway, validate):
    body = json.loads(gateway.curl("/generate", body={"inputs": PROMPT, "parameters": {"max_new_tokens": 5}}))
    validate(body, "GenerateResponse")
    assert set(body) == {"generated_text"}  # no details unless asked


def test_generate_answers_with_tgis_timing_headers(gateway):
    raw = gateway.curl("/generate", "-i", body={"inputs": PROMPT, "parameters": {"max_new_tokens": 4}})
    head, _, body = raw.replace("\r\n", "\n").partition("\n\n")
    headers = dict(line.lower().split(": ", 1) for line in head.split("\n")[1:])
    assert json.loads(body)["generated_text"]
    assert int(headers["x-generated-tokens"]) == 4 and int(headers["x-prompt-tokens"]) > 0
    assert headers["x-compute-characters"] == str(len(PROMPT))
    times = {name: int(headers[f"x-{name}-time"]) for name in ("total", "validation", "queue", "inference")}
    assert times["validation"] + times["queue"] + times["inference"] <= times["total"] + 2  # ms rounding
    assert int(headers["x-time-per-token"]) <= times["inference"]
    assert float(headers["x-compute-time"]) * 1000 >= times["total"] - 1
    assert headers["x-compute-type"]


def test_generate_with_details(gateway, validate):
    parameters = {
        "max_new_tokens": 5,
        "details": True,
        "decoder_input_details": True,
        "top_n_tokens": 2,
        "do_sample": True,
        "seed": 2**64 - 1,
    }
    body = json.loads(gateway.curl("/generate", body={"inputs": PROMPT, "parameters": parameters}))
    validate(body, "GenerateResponse")
    details = body["details"]
    assert details["seed"] == 2**64 - 1  # a JSON number, exactly
    assert details["prefill"][0]["logprob"] is None  # NaN in the proto
    assert all(isinstance(t["logprob"], float) for t in details["prefill"][1:])
    assert len(details["top_tokens"]) == len(details["tokens"]) == 5
    assert all(isinstance(position, list) and len(position) >= 2 for position in details["top_tokens"])
    assert "best_of_sequences" not in details


def test_greedy_details_have_a_null_seed_and_no_top_tokens(gateway, validate):
    body = json.loads(
        gateway.curl("/generate", body={"inputs": PROMPT, "parameters": {"max_new_tokens": 3, "details": True}})
    )
    validate(body, "GenerateResponse")
    assert body["details"]["seed"] is None and body["details"]["prefill"] == []
    assert "top_tokens" not in body["details"] and "best_of_sequences" not in body["details"]


def test_best_of(gateway, validate):
    parameters = {"max_new_tokens": 3, "best_of": 2, "do_sample": True, "details": True}
    body = json.loads(gateway.curl("/generate", body={"inputs": PROMPT, "parameters": parameters}))
    validate(body, "GenerateResponse")
    [other] = body["details"]["best_of_sequences"]
    assert isinstance(other["seed"], int) and "top_tokens" not in other


def test_generate_stream(gateway, validate):
    raw = gateway.curl(
        "/generate_stream", "-N", "-i", body={"inputs": PROMPT, "parameters": {"max_new_tokens": 5, "details": True}}
    )
    status, headers, body = status_and_body(raw)
    assert status == 200 and headers["content-type"] == "text/event-stream"
    assert headers["cache-control"] == "no-cache"
    events = sse_events(body)
    for event in events:
        validate(event, "StreamResponse")
    assert [e["index"] for e in events] == list(range(1, len(events) + 1))
    assert all(e["generated_text"] is None and e["details"] is None for e in events[:-1])
    final = events[-1]
    assert final["generated_text"] == "".join(e["token"]["text"] for e in events if not e["token"]["special"])
    assert final["details"]["generated_tokens"] == len(events) and final["details"]["input_length"] > 0
    assert "top_tokens" not in final


def test_stream_top_tokens_are_flat(gateway, validate):
    events = sse_events(
        gateway.curl(
            "/generate_stream", "-N", body={"inputs": PROMPT, "parameters": {"max_new_tokens": 3, "top_n_tokens": 2}}
        )
    )
    for event in events:
        validate(event, "StreamResponse")
        assert len(event["top_tokens"]) >= 2 and all("id" in t for t in event["top_tokens"])
    assert events[-1]["details"] is None  # not asked


COMPAT_PATHS = pytest.mark.parametrize("path", ["/", "/invocations"])  # TGI's root route and SageMaker's


@COMPAT_PATHS
def test_compat_route(gateway, validate, path):
    body = json.loads(gateway.curl(path, body={"inputs": PROMPT, "parameters": {"max_new_tokens": 3}}))
    validate(body, {"type": "array", "items": {"$ref": "#/components/schemas/GenerateResponse"}})
    assert len(body) == 1 and body[0]["generated_text"].startswith(PROMPT)  # return_full_text default


@COMPAT_PATHS
def test_compat_route_streams(gateway, validate, path):
    events = sse_events(
        gateway.curl(path, "-N", body={"inputs": PROMPT, "stream": True, "parameters": {"max_new_tokens": 3}})
    )
    for event in events:
        validate(event, "StreamResponse")
    assert events[-1]["generated_text"].startswith(PROMPT)


@COMPAT_PATHS
def test_compat_route_reads_stream_from_the_top_level_only(gateway, path):
    body = json.loads(
        gateway.curl(path, body={"inputs": 'say "stream": true', "parameters": {"max_new_tokens": 2, "stream": True}})
    )
    assert isinstance(body, list)


def test_get_invocations_is_not_a_health_alias(gateway):
    status, _, body = status_and_body(gateway.curl("/invocations", "-i"))
    assert status in (404, 405) and json.loads(body)["error"]


def test_tokenize(gateway, validate):
    body = json.loads(gateway.curl("/tokenize", body={"inputs": PROMPT}))
    validate(body, "TokenizeResponse")
    assert body and all(0 <= t["start"] <= t["stop"] <= len(PROMPT) for t in body)


def test_info(gateway, validate):
    body = json.loads(gateway.curl("/info"))
    validate(body, "Info")
    assert body["model_sha"] is None and body["sha"] is None
    assert isinstance(body["stats"]["num_steps"], int)


def test_health_and_aliases(gateway):
    for path in ("/health", "/", "/ping"):
        status, _, body = status_and_body(gateway.curl(path, "-i"))
        assert (status, body) == (200, ""), path


def test_metrics(gateway):
    status, headers, body = status_and_body(gateway.curl("/metrics", "-i"))
    assert status == 200 and headers["content-type"].startswith("text/plain")
    assert "# HELP" in body


def test_models(gateway):
    body = json.loads(gateway.curl("/v1/models"))
    info = gateway.server.engine.info
    card = {"id": info.model_id, "object": "model", "created": info.loaded_at, "owned_by": info.model_id}
    assert body == {"object": "list", "data": [card]}
    assert 0 < info.loaded_at <= time.time()  # when the server loaded the model, not 0


def test_unknown_request_fields_and_nulls_are_accepted(gateway, validate):
    body = json.loads(
        gateway.curl(
            "/generate",
            body={
                "inputs": PROMPT,
                "model": "tgi",
                "parameters": {
                    "max_new_tokens": 2,
                    "seed": None,
                    "grammar": None,
                    "stop": [],
                    "unknown": {"nested": [1]},
                },
            },
        )
    )
    validate(body, "GenerateResponse")


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"top_p": 1.0}, "`top_p` must be > 0.0 and < 1.0"),
        ({"temperature": 0}, "`temperature` must be strictly positive"),
        ({"top_n_tokens": 100}, "`top_n_tokens` must be >= 0 and <= 5"),
        # TGI's grammar shapes all reach validation (a schema object, its JSON text, a regex).
        (
            {"grammar": {"type": "json", "value": {"properties": {"a": {"type": "nope"}}}}},
            "grammar is not valid: Invalid type: nope",
        ),
        ({"grammar": {"type": "json", "value": '{"properties": '}}, "grammar is not valid: the schema is not JSON"),
        ({"grammar": {"type": "regex", "value": "[0-9"}}, "grammar is not valid: "),
    ],
)
def test_validation_errors(gateway, validate, parameters, message):
    status, headers, body = status_and_body(
        gateway.curl("/generate", "-i", body={"inputs": PROMPT, "parameters": parameters})
    )
    error = json.loads(body)
    validate(error, "ErrorResponse")
    assert (status, error["error_type"]) == (422, "validation") and message in error["error"]
    assert headers["content-type"] == "application/json"
    assert not any(name.startswith("grpc-") for name in headers)


@pytest.mark.parametrize(
    "grammar",
    [
        {
            "type": "json",
            "value": {
                "type": "object",
                "properties": {"n": {"type": "integer", "maximum": 99}},
                "required": ["n"],
                "additionalProperties": False,
            },
        },
        {
            "type": "json_schema",
            "value": {
                "name": "n",
                "schema": {
                    "type": "object",
                    "properties": {"n": {"type": "integer", "maximum": 99}},
                    "required": ["n"],
                    "additionalProperties": False,
                },
            },
        },
        {"type": "regex", "value": "[0-9]{3}-[a-z]{2,4}"},
    ],
)
def test_grammar_constrains_generate_and_stream(gateway, validate, grammar):
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 60, "grammar": grammar, "details": True}}
    response = json.loads(gateway.curl("/generate", body=body))
    validate(response, "GenerateResponse")
    text = response["generated_text"]
    if grammar["type"] == "regex":
        assert re.fullmatch(grammar["value"], text), text
    else:
        assert list(json.loads(text)) == ["n"] and json.loads(text)["n"] <= 99
        assert response["details"]["finish_reason"] == "eos_token"
    events = sse_events(status_and_body(gateway.curl("/generate_stream", "-i", body=body))[2])
    assert events[-1]["generated_text"] == text


def test_stream_errors_are_in_band(gateway, validate):
    raw = gateway.curl("/generate_stream", "-i", body={"inputs": PROMPT, "parameters": {"top_p": 1.0}})
    status, _, body = status_and_body(raw)
    [event] = sse_events(body)
    validate(event, "ErrorResponse")
    assert status == 200 and event["error_type"] == "validation" and "`top_p`" in event["error"]


@pytest.mark.parametrize(
    ("args", "status", "error_type"),
    [
        (("-X", "POST", "-d", '{"inputs":', "-H", "Content-Type: application/json"), 400, "validation"),
        (("-X", "POST", "-d", '{"inputs": 5}'), 400, "validation"),
        (
            (
                "-X",
                "GET",
            ),
            405,
            "method_not_allowed",
        ),
    ],
)
def test_malformed_requests_get_json_errors(gateway, validate, args, status, error_type):
    got_status, headers, body = status_and_body(gateway.curl("/generate", "-i", *args))
    error = json.loads(body)
    validate(error, "ErrorResponse")
    assert (got_status, error["error_type"]) == (status, error_type)
    assert headers["content-type"] == "application/json"


def test_unknown_routes_are_json_404(gateway, validate):
    for path in ("/nope", "/generate/extra"):
        status, _, body = status_and_body(gateway.curl(path, "-i"))
        validate(json.loads(body), "ErrorResponse")
        assert status == 404, path
    # Under OpenAI's /v1 the 404 is OpenAI's error object, what its SDK reads.
    status, _, body = status_and_body(gateway.curl("/v1/chat/completions/x", "-i"))
    assert status == 404 and json.loads(body)["error"]["type"] == "invalid_request_error"
